"""The engine side of MoE routing agreement on the hookable V1 runner (vllm 0.32, in-process, eager):
which experts vLLM's routers picked for every token of every request, threaded by request id.

    capture = RouteCapture(engine)                  # flip=P: the moe-route-flip fault as well
    rollouts = engine.generate(prompts, step=0)
    experts = capture.response_experts("7", prompt_len, num_tokens)   # (T, L, k) int64
    capture.clear()                                 # between steps; capture.remove() at the end

`VLLMEngine` records routing itself (`VLLMConfig.moe_routing`, `EngineRoutes`): with these hooks where
it can (one in-process V1 worker: CPU, or a hookable engine), else through vLLM's own
`enable_return_routed_experts` (the V2 runner on CUDA); each `Rollout.experts` is then (T, L, k).

A forward hook on every MoE router (`rlcheck.engines.moe_routing.moe_gates`) reads the top-k of its
logits (the experts the softmax-then-top-k router picks), row by row. Which row is whose comes from
`LayerCapture`'s mechanism (`rlcheck.engines.layer_capture`): the runner's `execute_model` and
`_model_forward`, the step's `query_start_loc` and positions. With `flip` the `RouteFlip` hooks run
first, so what is recorded is the routing the engine used.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from rlcheck.engines.layer_capture import LayerCapture
from rlcheck.engines.moe_routing import (
    NEAR_TIE,
    RouteFlip,
    experts_per_token,
    is_moe_model,
    moe_gates,
    response_rows,
    routed_experts_response,
)
from rlcheck.errors import ConfigError, InputError


class _Everyone:
    """A target set that holds every request id."""

    def __contains__(self, item: object) -> bool:
        return item is not None


class RouteCapture(LayerCapture):
    """Hooks on one engine's MoE routers that keep every request's experts (and apply `flip`); see
    the module docstring. Reuses `LayerCapture`'s runner hooks (`execute_model`, `_model_forward`),
    its row bookkeeping and `remove`."""

    def __init__(self, engine: Any, *, flip: float = 0.0, near_tie: float = NEAR_TIE, seed: int = 0):
        from rlcheck.engines.vllm_faults import model_runner

        self.runner = runner = model_runner(engine)
        if not runner.model_config.enforce_eager:
            raise ConfigError("MoE routing capture needs an eager vLLM engine (enforce_eager=True): "
                              "a compiled graph calls no hooks")
        self.top_k = int(runner.model_config.hf_text_config.num_experts_per_tok)
        self.flipper = RouteFlip(engine, flip, near_tie=near_tie, seed=seed) if flip else None
        self.targets = _Everyone()
        gates = moe_gates(runner.get_model())
        self.num_layers = len(gates)
        self._chunks: dict[str, list[list[tuple[np.ndarray, np.ndarray]]]] = {}
        self._rows, self._live = None, False
        self._hooks = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(gates)]
        self._had = {name: runner.__dict__.get(name) for name in ("execute_model", "_model_forward")}
        self._execute, self._forward = runner.execute_model, runner._model_forward
        runner.execute_model, runner._model_forward = self._execute_model, self._model_forward

    def experts(self, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """(positions (n,) ascending, experts (n, L, k) int64) of one request; n = 0 if it never ran."""
        chunks = self._chunks.get(request_id)
        if chunks is None:
            return np.zeros(0, dtype=np.int64), np.zeros((0, self.num_layers, self.top_k), dtype=np.int64)
        per_layer = [self._joined(layer) for layer in chunks]
        return per_layer[0][0], np.stack([e for _, e in per_layer], axis=1)  # (n,), (n, L, k)

    def response_experts(self, request_id: str, prompt_len: int, num_tokens: int) -> np.ndarray:
        """(num_tokens, L, k) int64: the experts that routed each response token of `request_id`."""
        positions, experts = self.experts(request_id)
        return response_rows(experts, positions, prompt_len, num_tokens)

    def remove(self) -> None:
        """Unhook the routers and the runner, and the flip if any (idempotent)."""
        super().remove()
        if self.flipper is not None:
            self.flipper.remove()

    def clear(self) -> None:
        """Forget every request's routing (keep the hooks): call once a step's requests are read."""
        self._chunks = {}

    @staticmethod
    def _joined(chunks: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """One layer's chunks in position order, a recomputed position keeping its first routing."""
        pos = np.concatenate([p for p, _ in chunks])
        rows = np.concatenate([e for _, e in chunks])
        order = np.argsort(pos, kind="stable")
        _, first = np.unique(pos[order], return_index=True)
        keep = order[first]
        return pos[keep], rows[keep]

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, out: Any) -> None:
            logits = out[0] if isinstance(out, tuple) else out
            if self._rows is not None:
                index, parts = self._rows
                chosen = logits.index_select(0, index).topk(self.top_k, dim=-1).indices.cpu().numpy()  # (rows, k)
                for rid, part, pos in parts:
                    per_layer = self._chunks.setdefault(rid, [[] for _ in range(self.num_layers)])
                    per_layer[layer].append((pos, chosen[part].astype(np.int64)))

        return hook


ROUTING_MODES = ("auto", "on", "off")


def routing_plan(cfg: Any, cuda: bool | None = None) -> str:
    """How an engine of `cfg` (a `VLLMConfig`) records MoE routing: "hooks" (`RouteCapture`), "vllm"
    (`enable_return_routed_experts`, the V2 runner on CUDA) or "off". `cfg.moe_routing` "auto" is on
    for an MoE model where either way works; "on" refuses (ConfigError) where neither does. `cuda`
    None: ask torch."""
    if cfg.moe_routing == "off" or (cfg.moe_routing == "auto" and not is_moe_model(cfg.model)):
        return "off"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    hookable = cfg.hookable or cfg.guard is not None
    if cuda and not hookable:
        return "vllm"
    if cfg.tensor_parallel_size > 1:
        if cfg.moe_routing == "on":
            raise ConfigError(f"moe_routing='on' with tensor_parallel_size={cfg.tensor_parallel_size}: the router "
                              "hooks need one in-process worker (vLLM's routed_experts needs its V2 runner, CUDA); "
                              "use tensor_parallel_size=1 or moe_routing='auto'")
        return "off"
    if not cfg.enforce_eager:
        if cfg.moe_routing == "on":
            raise ConfigError("moe_routing='on' needs enforce_eager=True on this runner (a compiled graph calls no hooks)")
        return "off"
    return "hooks"


class EngineRoutes:
    """The routing record of one `VLLMEngine` (see the module docstring): `response` gives a
    completion's (T, L, k) experts, `clear` forgets a call's requests. Where a completion's routing
    cannot be read (vLLM's `routed_experts` None or in another layout, positions the hooks did not
    see), its experts are None, "routing not available", said in one warning per engine: a monitor
    never fails a rollout (the loop then compares no routing for the step)."""

    def __init__(self, engine: Any, plan: str):
        self.plan = plan
        self.capture = RouteCapture(engine) if plan == "hooks" else None
        self.top_k = experts_per_token(engine.cfg.model) if plan == "vllm" else None
        self.unavailable = 0
        """Completions whose routing could not be read."""

    def response(self, completion: Any, vllm_request_id: str, prompt_len: int, num_tokens: int) -> np.ndarray | None:
        try:
            if self.capture is None:
                routed = getattr(completion, "routed_experts", None)
                if routed is None:
                    raise InputError("vLLM returned no routed_experts (enable_return_routed_experts off, or a "
                                     "runner that does not record them)")
                return routed_experts_response(routed, prompt_len, num_tokens, self.top_k)
            return self.capture.response_experts(vllm_request_id, prompt_len, num_tokens)
        except (InputError, TypeError, ValueError) as exc:
            self.unavailable += 1
            if self.unavailable == 1:
                warnings.warn(f"rlcheck: MoE routing not available (request {vllm_request_id}: {exc}); the rollouts "
                              "go on without it, and a step missing any rollout's routing compares none",
                              RuntimeWarning, stacklevel=2)
            return None

    def clear(self) -> None:
        if self.capture is not None:
            self.capture.clear()

    def remove(self) -> None:
        if self.capture is not None:
            self.capture.remove()


def engine_routes(engine: Any) -> EngineRoutes | None:
    """The MoE routing record of a `VLLMEngine` (its `cfg`'s `routing_plan`), or None when off."""
    plan = routing_plan(engine.cfg)
    return None if plan == "off" else EngineRoutes(engine, plan)
