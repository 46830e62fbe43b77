"""MoE routing in the rollout engine: the routers of a model, the `moe-route-flip` fault that makes
vLLM's routers pick another expert on near-ties, and the response rows of a routing record.

    handle = RouteFlip(engine, 0.1)                # or inject(engine, "moe-route-flip", flip=0.1)
    experts = routed_experts_response(completion.routed_experts, prompt_len, num_tokens)  # CUDA, V2

The recorder of the hookable V1 runner is `rlcheck.engines.moe_capture.RouteCapture`; the trainer's,
`rlcheck.trainers.moe_routing.RouteRecorder`. Every MoE decoder layer's router is `layer.mlp.gate`
(a `GateLinear` in vLLM's Qwen3-MoE, called by the fused-MoE runner as `router_logits, _ =
self.gate(hidden)`: moe_runner.py; `Qwen3MoeTopKRouter` in HF).

The sampled token at position p is predicted by the forward of position p - 1, so a response token
i (after a prompt of P tokens) is routed at position P - 1 + i: `response_rows` takes those rows,
from a capture and from vLLM's own `CompletionOutput.routed_experts` ([positions, layers, top_k],
`enable_return_routed_experts`, which needs the V2 runner and so Triton: CUDA only).

The fault: a forward hook rewrites the router logits of the engine's forwards: of the tokens whose
k-th and (k+1)-th logits lie within `near_tie` (a near-tie, where bf16 router noise flips the
choice), a fraction P swap those two logits, so the k-th expert is replaced by the next. Installed
through `LLM.apply_model` (in-process engines: the hook handles come back as objects).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.errors import ConfigError, InputError

NEAR_TIE = 0.05
"""Router-logit gap between the k-th and the (k+1)-th expert under which `moe-route-flip` may swap them."""


def moe_gates(model: Any) -> list[Any]:
    """The router of every MoE decoder layer (`layer.mlp.gate`) of a vLLM or HF model, in layer order."""
    from rlcheck.engines.vllm_perturb import decoder_layers

    gates = [layer.mlp.gate for layer in decoder_layers(model) if hasattr(getattr(layer, "mlp", None), "gate")]
    if not gates:
        raise ConfigError(f"{type(model).__name__} has no MoE router (layer.mlp.gate): routing needs an MoE model")
    return gates


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that give an MoE model's expert count (Qwen-MoE, Mixtral/gpt-oss, DeepSeek)."""


def text_config(model_dir: str) -> dict[str, Any]:
    """The HF model directory's config.json with its text config's fields on top ({} without one)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {**config, **config.get("text_config", {})}


def is_moe_model(model_dir: str) -> bool:
    """Whether the HF model directory's config.json (or its text config) describes a mixture of experts."""
    config = text_config(model_dir)
    return any(int(config.get(key) or 0) > 1 for key in EXPERT_COUNT_KEYS)


def flip_near_ties(logits: Any, top_k: int, frac: float, near_tie: float, generator: Any) -> Any:
    """`logits` (N, E) with the k-th and (k+1)-th logits swapped on a fraction `frac` of the rows
    whose two lie within `near_tie` (a copy; the input is left alone)."""
    import torch

    vals, idx = logits.topk(top_k + 1, dim=-1)  # (N, k+1)
    tie = (vals[:, top_k - 1] - vals[:, top_k]) < near_tie
    draw = torch.rand(logits.shape[0], generator=generator, device="cpu").to(logits.device) < frac
    rows = torch.nonzero(tie & draw).flatten()
    out = logits.clone()
    out[rows, idx[rows, top_k - 1]] = vals[rows, top_k]
    out[rows, idx[rows, top_k]] = vals[rows, top_k - 1]
    return out


def response_rows(experts: np.ndarray, positions: np.ndarray, prompt_len: int, num_tokens: int) -> np.ndarray:
    """(num_tokens, L, k): the rows of `experts` (n, L, k) at positions prompt_len - 1 ..
    prompt_len + num_tokens - 2, the forwards that predicted the response tokens."""
    want = np.arange(prompt_len - 1, prompt_len - 1 + num_tokens)
    at = np.searchsorted(positions, want)
    if num_tokens and (at[-1] >= positions.size or not np.array_equal(positions[np.minimum(at, positions.size - 1)], want)):
        raise InputError(f"routing covers positions {positions[:1]}..{positions[-1:]}, the response needs "
                         f"{prompt_len - 1}..{prompt_len + num_tokens - 2}: was the prompt cached, or the request cut?")
    return experts[at]


def routed_experts_response(routed: Any, prompt_len: int, num_tokens: int, top_k: int | None = None) -> np.ndarray:
    """(num_tokens, L, k) int64 of vLLM's `CompletionOutput.routed_experts` ([positions, L, k]; CUDA,
    V2 runner, `enable_return_routed_experts=True`): the rows that routed the response tokens; `top_k`:
    the model's experts per token, which the last axis must hold (InputError for another layout)."""
    arr = np.asarray(routed, dtype=np.int64)
    if arr.ndim != 3 or (top_k is not None and arr.shape[2] != top_k):
        raise InputError(f"routed_experts has shape {arr.shape}; vLLM returns [positions, layers, top_k]"
                         + (f" with top_k {top_k}" if top_k is not None else ""))
    return response_rows(arr, np.arange(arr.shape[0]), prompt_len, num_tokens)


def experts_per_token(model_dir: str) -> int | None:
    """The HF model directory's `num_experts_per_tok` (or its text config's), None where it has none."""
    value = text_config(model_dir).get("num_experts_per_tok")
    return int(value) if value else None


class RouteFlip:
    """moe-route-flip on one engine: a hook on every MoE router that swaps near-tie experts (see the
    module docstring), until `remove()`."""

    def __init__(self, engine: Any, flip: float, *, near_tie: float = NEAR_TIE, seed: int = 0):
        import torch

        if not 0.0 <= flip <= 1.0:
            raise ConfigError(f"moe-route-flip={flip}: the flipped fraction of near-tie tokens must be in [0, 1]")
        llm = getattr(engine, "llm", engine)
        if llm is None:
            raise ConfigError("the engine is closed")
        self.flip, self.near_tie = flip, near_tie
        self.generator = torch.Generator().manual_seed(seed)
        self._hooks = llm.apply_model(self._install)[0]

    def _install(self, model: Any) -> list[Any]:
        import torch

        top_k = int(model.config.num_experts_per_tok)

        def hook(module: Any, args: Any, out: Any) -> Any:
            if not torch.is_inference_mode_enabled():
                return None  # not the engine's forward (vLLM runs it in inference mode): the sync check's
                # one-hot probes of the router's weights, which router noise does not change
            logits = out[0] if isinstance(out, tuple) else out
            flipped = flip_near_ties(logits, top_k, self.flip, self.near_tie, self.generator)
            return (flipped, *out[1:]) if isinstance(out, tuple) else flipped

        # prepended: the routing the engine used is the flipped one, whenever a recorder was hooked
        return [gate.register_forward_hook(hook, prepend=True) for gate in moe_gates(model)]

    def remove(self) -> None:
        """Unhook the routers (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> RouteFlip:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
