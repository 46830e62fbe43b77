"""The trainer side of MoE routing agreement: the experts each MoE layer's router picked in the very
forward that recomputes the logprobs (no second pass), read by a forward hook on every router.

    with RouteRecorder(model) as routes:                        # HF Qwen3-MoE (layer.mlp.gate)
        logp = token_logprobs(model, input_ids)                   # any forward, chunked or not
    experts = routes.experts(input_ids.shape)                     # (B, T, L, k) int64

HF's Qwen3-MoE router (`Qwen3MoeTopKRouter`) returns (logits, top-k weights, top-k indices); a router
that returns logits alone (vLLM's, or HF's `output_router_logits` path) is read as the top-k of its
logits. A response token i after a prompt of P tokens is routed at position P - 1 + i, as on the
engine side (`rlcheck.engines.moe_routing.response_rows`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.errors import InputError


class RouteRecorder:
    """Forward hooks on every MoE router of `model` that keep the chosen experts of each forward."""

    def __init__(self, model: Any, top_k: int | None = None):
        from rlcheck.engines.moe_routing import moe_gates

        gates = moe_gates(model)
        config = getattr(model, "config", None)
        self.top_k = int(top_k or getattr(gates[0], "top_k", None) or config.num_experts_per_tok)
        self._rows: list[list[np.ndarray]] = [[] for _ in gates]
        self._hooks = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(gates)]

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, out: Any) -> None:
            if isinstance(out, tuple) and len(out) == 3:
                chosen = out[2]  # (N, k) HF's top-k indices
            else:
                logits = out[0] if isinstance(out, tuple) else out
                chosen = logits.topk(self.top_k, dim=-1).indices
            self._rows[layer].append(chosen.detach().reshape(-1, self.top_k).cpu().numpy().astype(np.int64))

        return hook

    def experts(self, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """(N, L, k) int64 of every token the recorded forwards routed, in order (reshaped to
        (*shape, L, k) when `shape` is given, e.g. the (B, T) of the input ids)."""
        if not self._rows[0]:
            return np.zeros((0, len(self._rows), self.top_k), dtype=np.int64)
        out = np.stack([np.concatenate(rows) for rows in self._rows], axis=1)  # (N, L, k)
        if shape is not None:
            if int(np.prod(shape)) != out.shape[0]:
                raise InputError(f"the routers saw {out.shape[0]} tokens, not the {tuple(shape)} asked for")
            out = out.reshape(*shape, *out.shape[1:])
        return out

    def clear(self) -> None:
        """Forget what was recorded (keep the hooks): one recorder across steps."""
        self._rows = [[] for _ in self._rows]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> RouteRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def response_experts(experts: np.ndarray, lengths: list[int], responses: list[int], width: int | None) -> list[np.ndarray]:
    """Each sequence's (T, L, k) experts of its response tokens from one forward's record `experts`
    (N, L, k): rows packed one after another (`width` None) or right-padded to `width` tokens."""
    from rlcheck.engines.moe_routing import response_rows

    out, start = [], 0
    for n, t in zip(lengths, responses, strict=True):
        rows = experts[start:start + n]
        out.append(response_rows(rows, np.arange(n), n - t, t))
        start += n if width is None else width
    return out
