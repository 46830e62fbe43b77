"""Engine-level Mamba state faults inside a real, in-process vLLM engine (vllm 0.32 only).

    handle = inject(engine, "stale-state")           # or "index-wrap", boundary=4; or "none" (trace only)
    rollouts = engine.generate(prompts, step=0)
    handle.affected      # {vllm request id: why}   handle.events: who held which state slot, per step
    handle.take_touched()  # the requests (ids as LLM.generate reports them) it touched since the last take
    handle.remove()      # or `with inject(...) as handle:`

Faults (the two state faults change only what the Mamba2 layers are told, never the weights or the
scheduler; perturb-layer changes one layer's output):
- "stale-state": a request's first prefill starts from the conv and SSM state that the previous
  holder of its state slot left there, instead of zeros: the shape of vLLM's decode-before-prefill
  bug. Slots never held before stay zero-initialised, so first-wave requests are clean; requests
  that reuse a slot diverge from their first generated token.
- "index-wrap", boundary=B: a state slot (block id b >= 1, slot = b - 1) at or past B is addressed
  as slot % B, as a wrapped 32-bit offset would be. Harmless while the engine holds at most B
  blocks (vLLM hands out freed blocks LIFO, so ids stay below the peak number held); past that a
  request reads and writes another live request's state (or, in the hybrid, its attention KV
  page), corrupting both from their second generated token. Raise concurrency (max_num_seqs,
  n) and it appears; cut memory (kv_cache_bytes) or concurrency and it vanishes. B counts blocks of
  every KV group: the tiny mamba2 holds 1 per request, the tiny hybrid 4 (3 Mamba + 1 attention).
- "none": no fault, the slot trace only (which request held which slot when, for reports).
- "perturb-layer", layer=K: decoder layer K's output projection (attention `self_attn.o_proj`, Mamba
  `mamba.out_proj` / `mixer.out_proj`) computes 1.01 x its output, in this engine only (the HF
  reference and the trainer keep the true weights), from now on and after every `sync_weights` of a
  `VLLMEngine`: the shape of a weight that is wrong in one layer of the engine. Any model; no slot
  trace (`rlcheck.engines.vllm_perturb.PerturbHandle`).

Where this hooks in vllm 0.32.0 (paths under site-packages/vllm):
- Runner: `LLM.llm_engine.engine_core` (InprocClient when VLLM_ENABLE_V1_MULTIPROCESSING=0)
  `.engine_core.model_executor.driver_worker.worker.model_runner`, a CPUModelRunner
  (v1/worker/cpu_model_runner.py:23) subclassing GPUModelRunner.
- Slot indices: GPUModelRunner._build_attention_metadata (v1/worker/gpu_model_runner.py:2249;
  called at :4142 in execute_model) builds one metadata per KV group: Mamba2AttentionMetadataBuilder
  .build (v1/attention/backends/mamba2_attn.py:144) -> _compute_common_metadata
  (v1/attention/backends/mamba_attn.py:393), whose `state_indices_tensor` is the block table
  (mamba_get_block_table_tensor, v1/attention/backends/utils.py:1163: "none" mode returns it as is,
  "align" mode gathers the current block) split at mamba_attn.py:482 into decode rows
  `state_indices_tensor_d` and prefill rows `state_indices_tensor_p`; other groups with the same spec
  reuse it through update_block_table (gpu_model_runner.py:2488, mamba_attn.py:726).
- Zero-init decision: `has_initial_states_p = num_computed_tokens > 0` (mamba_attn.py:508) and the
  Mamba2-only `prep_initial_states` (mamba2_attn.py:177); consumed by the CPU causal conv
  (model_executor/layers/mamba/ops/cpu/causal_conv1d.py:57, zeros otherwise) and the SSD scan
  (model_executor/layers/mamba/mamba_mixer2.py:840-846, torch.where(..., ssm_state[idx], 0)).
  Freed Mamba blocks are never zeroed (cpu_model_runner.py:114 zeroes attention blocks only), so the
  stale state is really there. Freed blocks go to the front of the free queue (v1/core/block_pool.py:774).
The hook replaces `_build_attention_metadata` on that runner *instance* (no class is patched, other
engines in the process are untouched) and rewrites the Mamba2 metadata it returns with
dataclasses.replace on cloned index tensors (on CPU the block table tensor is vLLM's own buffer).
`remove()` deletes the instance attribute. Remove between `generate` calls: a request running across
it keeps the state the fault gave it. The engine guard (`rlcheck.engines.guard`) hooks other methods
of the same runner (`execute_model`, `_model_forward`) and reads the metadata after this rewrite, as
the kernels do; the two may be installed in either order. Refused: other vLLM versions, a multiprocess engine, tensor
parallelism, speculative decoding, full CUDA graphs, models without Mamba2 layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

from rlcheck.engines.vllm_hookable import HOOKABLE_ENV, hookable_kwargs, hookable_settings  # noqa: F401 - their home before
from rlcheck.errors import ConfigError, UnsupportedVLLMError
from rlcheck.versions import require_vllm

FAULTS = ("none", "stale-state", "index-wrap", "perturb-layer", "moe-route-flip")


class SlotEvent(NamedTuple):
    step: int  # forward step of this engine since inject, from 1
    request_id: str  # vLLM's internal id ("{external id}-{8 random chars}")
    group: int  # KV cache group (one per Mamba layer in the hybrid)
    phase: str  # "prefill" or "decode"
    block: int  # the state slot vLLM assigned (block id)
    used: int  # the slot the layer was told to use (differs under index-wrap)
    previous: str | None  # on a request's first prefill: the last other request that held `block`


def external_id(request_id: str) -> str:
    """The id `LLM.generate` reported for an internal request id (vLLM appends "-" + 8 characters)."""
    head, _, tail = request_id.rpartition("-")
    return head if head and len(tail) == 8 else request_id


def model_runner(engine: Any) -> Any:
    """The model runner of an in-process vLLM 0.32 engine (a `VLLMEngine` or a `vllm.LLM`); refused
    (UnsupportedVLLMError, ConfigError) as `inject` refuses it. For tools that hook the runner."""
    return _model_runner(engine)


def _model_runner(engine: Any) -> Any:
    import vllm

    require_vllm("vLLM fault injection (its Mamba metadata path)", str(vllm.__version__))
    llm = getattr(engine, "llm", engine)
    if llm is None:
        raise ConfigError("the engine is closed")
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise UnsupportedVLLMError("the engine runs in another process: build it with VLLM_ENABLE_V1_MULTIPROCESSING=0")
    worker = getattr(core.model_executor, "driver_worker", None)
    if worker is None:
        raise UnsupportedVLLMError("only single-process executors (tensor_parallel_size=1) can be hooked")
    runner = getattr(worker, "worker", worker).model_runner
    if runner.speculative_config is not None:
        raise UnsupportedVLLMError("speculative decoding changes the Mamba state layout; not supported")
    if runner.compilation_config.cudagraph_mode.has_full_cudagraphs():
        raise UnsupportedVLLMError("full CUDA graphs replay decode slot indices from the builder's own buffer "
                                   "(mamba_attn.py:655); build the engine with enforce_eager=True")
    if not callable(getattr(type(runner), "_build_attention_metadata", None)) or not hasattr(runner, "input_batch"):
        raise UnsupportedVLLMError(f"{type(runner).__module__}.{type(runner).__name__} has no _build_attention_metadata "
                                   "to hook (vLLM's V2 model runner? build the engine with VLLM_USE_V2_MODEL_RUNNER=0)")
    return runner


class FaultHandle:
    """An active fault on one engine; see the module docstring."""

    def __init__(self, runner: Any, fault: str, boundary: int | None, max_events: int):
        from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadata
        from vllm.v1.kv_cache_interface import MambaSpec

        self.fault, self.boundary, self.max_events = fault, boundary, max_events
        self.events: list[SlotEvent] = []
        self.affected: dict[str, str] = {}  # internal request id -> reason
        self._taken = 0  # `affected` entries handed out by take_touched
        self.step = 0
        self._runner, self._md_cls = runner, Mamba2AttentionMetadata
        groups = runner.kv_cache_config.kv_cache_groups
        self._num_groups = len(groups)
        self._mamba_group = {name: gid for gid, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
                             for name in g.layer_names}
        if not self._mamba_group:
            raise ConfigError("the engine's model has no Mamba layers: nothing for a state fault to act on")
        self._holder: dict[int, str] = {}  # block id -> last request seen holding it (any group)
        self._original = runner._build_attention_metadata
        runner._build_attention_metadata = self._build  # instance attribute: this runner only

    @property
    def active(self) -> bool:
        return self._runner.__dict__.get("_build_attention_metadata") == self._build

    def remove(self) -> None:
        """Restore the engine's own metadata path (idempotent)."""
        if self.active:
            del self._runner.__dict__["_build_attention_metadata"]

    @contextlib.contextmanager
    def suspended(self):
        """The engine's own metadata path until exit, then the fault again (an audit's own passes)."""
        was = self.active
        self.remove()
        try:
            yield self
        finally:
            if was:
                self._runner._build_attention_metadata = self._build

    def __enter__(self) -> FaultHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def affected_external(self) -> dict[str, str]:
        """`affected`, keyed by the ids `LLM.generate` returned."""
        return {external_id(k): v for k, v in self.affected.items()}

    def take_touched(self) -> set[str]:
        """The requests (as `LLM.generate` reports their ids) the fault touched since the last call: what
        the loop reports it did (`rlcheck.loop.driver`; none at all means it never fired)."""
        new = list(self.affected)[self._taken:]
        self._taken = len(self.affected)
        return {external_id(k) for k in new}

    # ---- the hook ------------------------------------------------------------------------------

    def _build(self, *args: Any, **kwargs: Any):
        out = self._original(*args, **kwargs)
        call = builder_arguments(self._original, args, kwargs)
        num_reqs = call.get("num_reqs")
        attn_metadata = out[0]
        req_ids = list(self._runner.input_batch.req_ids[: num_reqs or 0])
        if "num_reqs" not in call and self._runner.input_batch.num_reqs:
            raise UnsupportedVLLMError(
                f"the {self.fault} fault's hook cannot read num_reqs from vLLM's _build_attention_metadata call "
                f"(its arguments: {sorted(call)}) while the engine runs {self._runner.input_batch.num_reqs} "
                "request(s): it would see no step and never fire; this vLLM is not the one the hook was written for")
        if (call.get("for_cudagraph_capture") or call.get("ubatch_slices") is not None or not num_reqs
                or not isinstance(attn_metadata, dict) or len(req_ids) < num_reqs or None in req_ids):
            return out  # dummy / profiling runs
        self.step += 1
        step_blocks = self._step_blocks(num_reqs)  # gid -> per-row list of block ids
        holders_now = {b: req_ids[row] for blocks in step_blocks.values()
                       for row, bs in enumerate(blocks) for b in bs}
        done: dict[int, Any] = {}
        for name, md in list(attn_metadata.items()):
            if name in self._mamba_group and isinstance(md, self._md_cls):
                if id(md) not in done:
                    done[id(md)] = self._rewrite(self._mamba_group[name], md, req_ids, holders_now)
                attn_metadata[name] = done[id(md)]
        self._holder.update(holders_now)
        return out

    def _step_blocks(self, num_reqs: int) -> dict[int, list[list[int]]]:
        tables = self._runner.input_batch.block_table
        out = {}
        for gid in range(self._num_groups):
            bt = tables[gid]
            rows = bt.block_table.cpu[:num_reqs].tolist()
            out[gid] = [[b for b in r[: int(bt.num_blocks_per_row[i])] if b > 0] for i, r in enumerate(rows)]
        return out

    def _rewrite(self, gid: int, md: Any, req_ids: list[str], holders_now: dict[int, str]) -> Any:
        import torch

        nd, npf = md.num_decodes, md.num_prefills
        d = None if md.state_indices_tensor_d is None else md.state_indices_tensor_d.clone()
        p = None if md.state_indices_tensor_p is None else md.state_indices_tensor_p.clone()
        init = None if md.has_initial_states_p is None else md.has_initial_states_p.clone()
        changed, prep = False, md.prep_initial_states
        for row in range(nd + npf):
            rid = req_ids[row]
            is_p = row >= nd
            block = int(p[row - nd]) if is_p else int(d[row, 0])
            used, previous = block, None
            fresh = is_p and init is not None and not bool(init[row - nd])
            if fresh:
                prev = self._holder.get(block)
                previous = prev if prev is not None and prev != rid else None
            if self.fault == "stale-state" and fresh and previous is not None:
                init[row - nd] = True
                prep = changed = True
                self.affected[rid] = f"started from the state {external_id(previous)} left in block {block}"
            if self.fault == "index-wrap" and block > self.boundary:  # slot = block - 1 >= B
                used = (block - 1) % self.boundary + 1
                if is_p:
                    p[row - nd] = used
                else:
                    d[row, :] = used
                changed = True
                self.affected.setdefault(rid, f"block {block} wrapped to {used} (boundary {self.boundary})")
                victim = holders_now.get(used)
                if victim is not None and victim != rid:
                    self.affected.setdefault(victim, f"block {used} also used by {external_id(rid)} (wrapped)")
            if len(self.events) < self.max_events:
                self.events.append(SlotEvent(self.step, rid, gid, "prefill" if is_p else "decode", block, used, previous))
        if not changed:
            return md
        if init is not None:
            init = init.to(torch.bool)
        return dataclasses.replace(md, state_indices_tensor_d=d, state_indices_tensor_p=p,
                                   has_initial_states_p=init, prep_initial_states=prep)


def builder_arguments(builder: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of one `_build_attention_metadata` call by name, however vLLM passed them (by
    position or keyword; `builder` is the bound method, its signature without self). A call that does
    not fit the signature gives its keywords alone."""
    import inspect

    try:
        return dict(inspect.signature(builder).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


def inject(engine: Any, fault: str, *, boundary: int | None = None, layer: int | None = None,
           flip: float | None = None, max_events: int = 1_000_000) -> Any:
    """Turn on `fault` (one of FAULTS) in `engine` (a `VLLMEngine` or a `vllm.LLM`), for this engine
    only, until `handle.remove()`. `boundary` (index-wrap only): slots at or past it wrap, >= 1.
    `layer` (perturb-layer only): the decoder layer index K, from 0. `flip` (moe-route-flip only): the
    fraction of near-tie tokens rerouted (`rlcheck.engines.moe_routing.RouteFlip`)."""
    if fault not in FAULTS:
        raise ConfigError(f"unknown vLLM fault {fault!r}; choose one of {', '.join(FAULTS)}")
    if (fault == "index-wrap") != (boundary is not None):
        raise ConfigError("boundary is required by index-wrap and only by it")
    if boundary is not None and (not isinstance(boundary, int) or boundary < 1):
        raise ConfigError(f"boundary must be an int >= 1, got {boundary!r}")
    if (fault == "perturb-layer") != (layer is not None):
        raise ConfigError("layer is required by perturb-layer and only by it")
    if (fault == "moe-route-flip") != (flip is not None):
        raise ConfigError("flip is required by moe-route-flip and only by it")
    if fault == "moe-route-flip":
        from rlcheck.engines.moe_routing import RouteFlip

        return RouteFlip(engine, flip)
    if fault == "perturb-layer":
        from rlcheck.engines.vllm_perturb import PERTURB_FACTOR, PerturbHandle

        return PerturbHandle(engine, layer, PERTURB_FACTOR)
    runner = _model_runner(engine)
    if "_build_attention_metadata" in runner.__dict__:
        raise ConfigError("a fault is already injected into this engine; remove it first")
    return FaultHandle(runner, fault, boundary, max_events)
