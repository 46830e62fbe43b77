"""The engine side of `rlcheck localize` (and the runner hooks MoE routing capture reuses,
`rlcheck.engines.moe_capture`): the hidden state after every decoder layer, for chosen requests, inside
an in-process vLLM engine (vllm 0.32) at every prefill and decode step. The HF reference's side and the
comparison are `rlcheck.forensics.localize`.

    capture = LayerCapture(engine, {"7", "12"}, "granitemoehybrid")   # ids as LLM.generate reports them
    engine.generate(prompts, step=0)
    positions, states = capture.states("7")      # (T,) token positions, (L, T, H) float32
    capture.remove()

Which rows are a request's (the engine guard's mechanism, `rlcheck.engines.guard`): two instance
attributes of the engine's model runner, `execute_model` (marks a real step: profiling and dummy runs
come without one) and `_model_forward`, which vLLM calls with the step's flattened tokens. Row i of
every layer's input belongs to request `input_batch.req_ids[j]` for `query_start_loc[j] <= i <
query_start_loc[j + 1]` (input-batch order: the order the kernels see, decodes first for Mamba
models), at token position `positions[i]`. A forward hook on every decoder layer copies the chosen
requests' rows (only theirs) out of the layer's output as the residual stream (`LAYER_OUTPUT`). A
position computed twice (a preempted request recomputed) keeps its first value, the one that gave
the sampled token; positions vLLM took from its prefix cache are not computed, and not compared.
Needs an eager engine (`enforce_eager=True`, `VLLMEngine`'s default): a compiled graph calls no hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from rlcheck.errors import ConfigError

LAYER_OUTPUT = {"llama": "sum", "mamba2": "sum", "granitemoehybrid": "hidden", "qwen3_moe": "sum"}
"""HF model_type -> how vLLM's decoder layer output `(hidden, residual)` gives the residual stream that
HF's layer returns. "sum": hidden + residual, vLLM leaving the residual add to the next layer's fused
add-norm (Llama: the MLP output and the stream before it; Qwen3-MoE: the MoE block's output and the
stream; Mamba2: the mixer output and the stream).
"hidden": hidden alone, GraniteMoeHybrid adding both residuals inside the layer (its `residual` is the
stream between the mixer and the MLP). Checked on each model: a healthy fp32 engine then agrees with
HF to ~1e-6 at every layer. Another model needs its vLLM layer's forward read before it is added."""


def stream_mode(model_type: str) -> str:
    mode = LAYER_OUTPUT.get(model_type)
    if mode is None:
        raise ConfigError(f"localize reads the decoder layers of {', '.join(LAYER_OUTPUT)}, not {model_type!r}: "
                          "add it to rlcheck.engines.layer_capture.LAYER_OUTPUT once its vLLM layer's output "
                          "is checked against HF's")
    return mode


class LayerCapture:
    """Hooks on one engine that keep the per-layer hidden states of `request_ids`; see the module docstring."""

    def __init__(self, engine: Any, request_ids: Iterable[str], model_type: str):
        from rlcheck.engines.vllm_faults import model_runner
        from rlcheck.engines.vllm_perturb import decoder_layers

        self.mode = stream_mode(model_type)
        self.runner = runner = model_runner(engine)
        if not runner.model_config.enforce_eager:
            raise ConfigError("localize needs an eager vLLM engine (enforce_eager=True): a compiled graph calls no hooks")
        self.targets = set(request_ids)
        layers = decoder_layers(runner.get_model())
        self.num_layers = len(layers)
        self._chunks: dict[str, list[list[tuple[np.ndarray, np.ndarray]]]] = {
            rid: [[] for _ in layers] for rid in self.targets}
        self._rows: tuple[Any, list[tuple[str, slice, np.ndarray]]] | None = None
        self._live = False
        self._hooks = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]
        self._had = {name: runner.__dict__.get(name) for name in ("execute_model", "_model_forward")}
        self._execute, self._forward = runner.execute_model, runner._model_forward
        runner.execute_model, runner._model_forward = self._execute_model, self._model_forward

    def states(self, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """(positions (T,) ascending, states (L, T, H) float32) of one request; T = 0 if it never ran."""
        per_layer = []
        for chunks in self._chunks[request_id]:
            if not chunks:
                return np.zeros(0, dtype=np.int64), np.zeros((self.num_layers, 0, 0), dtype=np.float32)
            pos = np.concatenate([p for p, _ in chunks])
            rows = np.concatenate([h for _, h in chunks])
            order = np.argsort(pos, kind="stable")
            _, first = np.unique(pos[order], return_index=True)  # a recomputed position keeps its first value
            keep = order[first]
            per_layer.append((pos[keep], rows[keep]))
        positions = per_layer[0][0]
        if any(not np.array_equal(p, positions) for p, _ in per_layer):
            raise RuntimeError(f"request {request_id}: the layers saw different positions")
        return positions.astype(np.int64), np.stack([h for _, h in per_layer])

    def remove(self) -> None:
        """Unhook the layers and the runner (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for name, ours in (("execute_model", self._execute_model), ("_model_forward", self._model_forward)):
            if self.runner.__dict__.get(name) == ours:
                if self._had[name] is None:
                    del self.runner.__dict__[name]
                else:
                    setattr(self.runner, name, self._had[name])

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ---- the hooks -----------------------------------------------------------------------------

    def _execute_model(self, *args: Any, **kwargs: Any) -> Any:
        self._live = True
        try:
            return self._execute(*args, **kwargs)
        finally:
            self._live = False

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        live, self._live = self._live, False  # once per execute_model
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self._rows = self._step_rows(positions) if live and positions is not None else None
        try:
            return self._forward(*args, **kwargs)
        finally:
            self._rows = None

    def _step_rows(self, positions: Any) -> tuple[Any, list[tuple[str, slice, np.ndarray]]] | None:
        """The rows of every chosen request in this step, as one index tensor, and per request (request
        id, its slice of that index, its token positions); None when none of them runs."""
        import torch

        from rlcheck.engines.vllm_faults import external_id

        ib = self.runner.input_batch
        n = int(ib.num_reqs)
        starts = self.runner.query_start_loc.np[: n + 1].astype(np.int64)
        pos = positions.detach().cpu().numpy()
        pos = pos[0] if pos.ndim == 2 else pos  # M-RoPE's (3, T): the text position is row 0
        rows, parts = [], []
        for j, internal in enumerate(ib.req_ids[:n]):
            rid = None if internal is None else external_id(internal)
            if rid in self.targets and starts[j + 1] > starts[j]:
                done = sum(r.size for r in rows)
                rows.append(np.arange(starts[j], starts[j + 1]))
                parts.append((rid, slice(done, done + rows[-1].size), pos[rows[-1]].astype(np.int64)))
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(rows)).to(positions.device), parts

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, out: Any) -> None:
            if self._rows is None:
                return
            index, parts = self._rows
            hidden, residual = out if isinstance(out, tuple) else (out, None)
            h = hidden.index_select(0, index)  # a copy: the next layer's fused add-norm writes in place
            if self.mode == "sum" and residual is not None:
                h = h + residual.index_select(0, index)
            h = h.float().cpu().numpy()  # (rows, H), one transfer for every chosen request
            for rid, part, pos in parts:
                self._chunks[rid][layer].append((pos, h[part]))

        return hook
