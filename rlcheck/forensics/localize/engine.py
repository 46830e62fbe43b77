"""The engine side of `rlcheck localize`: the dump's engine settings and fault, and the re-run that
captures every decoder layer's hidden state of the chosen requests (`LayerCapture`) and, on an MoE
model, which experts its routers picked at each position (`RouteCapture`).

    runs = rerun_forced(seqs, chosen, model_dir, model_type, dtype, engine=None, progress=None, moe=True)
    run = runs[i]    # EngineRun: positions (T,), states (L, T, H), tokens, experts (T, L_moe, k) or None

`rerun_stress` re-runs a `rlcheck stress` workload whole; `rerun_forced` teacher-forces the chosen
requests, one prefill each (`rlcheck.forensics.localize` says when each is used). A fault the dump's
run had is re-injected into an engine localize starts (`inject_dump_fault`); a given engine is used as
it is and left open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.forensics.replay import DumpSequences

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class EngineRun:
    """One request as the engine re-ran it."""

    positions: np.ndarray  # (T,) token positions the engine computed, ascending
    states: np.ndarray  # (L, T, H) float32 residual stream after every decoder layer
    tokens: list[int]  # the response tokens it ran
    experts: np.ndarray | None = None  # (T, L_moe, k) int64 its routers' experts at `positions` (an MoE)


def fault_name(cfg: Any) -> str:
    """The fault of a `StressConfig`, with its value ("perturb-layer=2")."""
    value = cfg.fault_boundary if cfg.fault == "index-wrap" else cfg.layer
    return cfg.fault + ("" if value is None else f"={value}")


@dataclass(frozen=True)
class DumpFault:
    """The engine fault a teacher-forced re-run injects: `name` for the report ("none" for none), and
    (kind, options) for `rlcheck.engines.vllm_faults.inject` (None: nothing injected)."""

    name: str = "none"
    inject: tuple[str, dict[str, Any]] | None = None


def dump_fault(meta: dict[str, Any], spec: str | None = None) -> DumpFault:
    """The engine fault the dump's run had (context.fault, as `rlcheck demo --inject` wrote it), or
    `spec` in its place ("none": none). A spec this rlcheck cannot parse is an InputError, never read as
    no fault: the re-run would be clean and the report would say the dump had none. A fault outside the
    engine's forward pass (a trainer, data or sync fault) has nothing to re-inject: its name says so."""
    from rlcheck.core.run.context import read_context
    from rlcheck.engines.vllm_faults import FAULTS
    from rlcheck.errors import ConfigError, InputError
    from rlcheck.faults import parse_inject

    where = "localize's fault" if spec is not None else "the dump's fault (meta.json context.fault)"
    spec = read_context(meta).fault if spec is None else (None if spec == "none" else spec)
    if spec is None:
        return DumpFault()
    try:
        engine_fault = parse_inject(str(spec)).engine_fault()
    except ConfigError as exc:
        raise InputError(f"{where} {spec!r} does not parse in this rlcheck ({exc}); pass the fault to re-inject "
                         "(localize(fault=...), --fault SPEC), or 'none' to re-run without one") from None
    if engine_fault is None or engine_fault[0] not in FAULTS:
        return DumpFault(f"none ({spec} is not re-injected: a trainer, data or weight-sync fault, outside a re-run)")
    kind, options = engine_fault
    return DumpFault(kind + "".join(f"={v}" for v in options.values()), (kind, options))


def route_capture(engine: Any, moe: bool) -> Any:
    """A `RouteCapture` on `engine`'s routers for the re-run when `moe` (a context manager; else one that gives None)."""
    if not moe:
        return contextlib.nullcontext()
    from rlcheck.engines.moe_capture import RouteCapture

    return RouteCapture(engine)


def _engine_run(capture: Any, routes: Any, rid: str, tokens: list[int]) -> EngineRun:
    """One request's capture: its layer states, and its experts at the same positions (None if they differ)."""
    positions, states = capture.states(rid)
    if routes is None:
        return EngineRun(positions, states, tokens)
    at, experts = routes.experts(rid)
    keep = np.isin(at, positions)  # the positions whose hidden states were captured (the same, in order)
    return EngineRun(positions, states, tokens, experts[keep] if np.array_equal(at[keep], positions) else None)


def rerun_stress(cfg: Any, seqs: DumpSequences, chosen: list[int], model_type: str, engine: Any,
                 progress: Progress | None, moe: bool = False) -> dict[int, EngineRun]:
    """The stress workload again (see `rlcheck.forensics.localize`); the chosen requests' runs."""
    from rlcheck.forensics.localize.capture import LayerCapture
    from rlcheck.forensics.stress import inject_faults, progress_bar, start_engine

    own = engine is None
    engine = engine or start_engine(cfg)
    handles: tuple[Any, ...] = inject_faults(engine, cfg)[:2] if own else ()
    try:
        offset = engine.llm.request_counter.counter  # vLLM numbers this engine's requests from here
        ids = {str(offset + i): i for i in chosen}
        bar = None if progress is None else progress_bar(lambda d, t: progress("re-running in vLLM (requests)", d, t))
        with LayerCapture(engine, ids, model_type) as capture, route_capture(engine, moe) as routes:
            rollouts = engine.generate(seqs.prompts, step=0, use_tqdm=bar or False)
            check_ids([r.vllm_request_id for r in rollouts], offset)
            return {i: _engine_run(capture, routes, rid, list(rollouts[i].token_ids)) for rid, i in ids.items()}
    finally:
        for h in handles:
            if h is not None:
                h.remove()
        if own:
            engine.close()


def rerun_forced(seqs: DumpSequences, chosen: list[int], model_dir: Path, model_type: str, dtype: str,
                 engine: Any, progress: Progress | None, moe: bool = False,
                 fault: DumpFault | None = None) -> dict[int, EngineRun]:
    """The chosen requests teacher-forced, one prefill each (see `rlcheck.forensics.localize`)."""
    from rlcheck.forensics.localize.capture import LayerCapture
    from rlcheck.forensics.stress import progress_bar

    forced = [seqs.prompts[i] + seqs.responses[i][:-1] for i in chosen]
    own = engine is None
    engine = engine or forced_engine(seqs.meta, model_dir, dtype, max(len(f) for f in forced) + 1)
    handle = inject_dump_fault(engine, fault or dump_fault(seqs.meta)) if own else None
    try:
        llm = getattr(engine, "llm", engine)  # a VLLMEngine or a vllm.LLM
        offset = llm.request_counter.counter
        ids = {str(offset + k): i for k, i in enumerate(chosen)}
        bar = None if progress is None else progress_bar(lambda d, t: progress("re-running in vLLM (requests)", d, t))
        from vllm import SamplingParams

        one = SamplingParams(max_tokens=1, temperature=0.0)  # the prefill is what counts; its one token is not
        with LayerCapture(engine, ids, model_type) as capture, route_capture(engine, moe) as routes:
            outputs = llm.generate([{"prompt_token_ids": f} for f in forced], one, use_tqdm=bar or False)
            check_ids([str(o.request_id) for o in outputs], offset)
            return {i: _engine_run(capture, routes, rid, list(seqs.responses[i])) for rid, i in ids.items()}
    finally:
        if handle is not None:
            handle.remove()
        if own:
            engine.close()


MIN_CACHE_BYTES = 64 << 20
"""The least cache a teacher-forced re-run gets when the dump recorded none (the tiny models need ~1 MiB)."""


def forced_cache_bytes(recorded: int | None, model_dir: Path, dtype: str, max_model_len: int) -> int:
    """The cache budget of localize's engine: the dump's engine's, else room for four sequences of
    `max_model_len` in the model's attention layers, at least MIN_CACHE_BYTES. A dump of a GPU run
    records none (vLLM sized its cache from the GPU's memory), and 64 MiB holds not even one 32k-token
    sequence of a 7B (1.8 GiB in bfloat16), which vLLM refuses."""
    if recorded:
        return int(recorded)
    from rlcheck.forensics.stress.config import kv_bytes_per_token

    per_token, _ = kv_bytes_per_token(str(model_dir), "float32" if dtype == "auto" else dtype)
    return max(MIN_CACHE_BYTES, 4 * per_token * max_model_len)


def forced_engine(meta: dict[str, Any], model_dir: Path, dtype: str, max_len: int) -> Any:
    """A greedy one-token engine with the dump's engine settings (`rlcheck.core.run.context`), long
    enough for its sequences, hookable (localize hooks every decoder layer; a dump's engine fault is
    injected into it)."""
    from rlcheck.core.run.context import read_context
    from rlcheck.engines.vllm import VLLMConfig, VLLMEngine
    from rlcheck.errors import ConfigError

    settings = read_context(meta).engine
    max_model_len = max(256, max_len)
    cfg = VLLMConfig(model=str(model_dir), dtype=dtype, greedy=True, max_tokens=1, engine_id="localize",
                     max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs, hookable=True, moe_routing="off",
                     kv_cache_bytes=forced_cache_bytes(settings.kv_cache_bytes, model_dir, dtype, max_model_len))
    try:
        return VLLMEngine(cfg)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"vLLM refused the dump's engine settings: {str(exc).splitlines()[0]}") from exc


def inject_dump_fault(engine: Any, fault: DumpFault) -> Any:
    """`fault` (`dump_fault`) injected into `engine`: its handle, or None."""
    if fault.inject is None:
        return None
    from rlcheck.engines import vllm_faults

    kind, options = fault.inject
    return vllm_faults.inject(engine, kind, **options)


def check_ids(got: list[str], offset: int) -> None:
    """A RuntimeError unless vLLM numbered the re-run's requests from `offset` on, in order."""
    if got != [str(offset + i) for i in range(len(got))]:
        raise RuntimeError(f"vLLM numbered the re-run's requests {got[:4]}..., not from {offset}: "
                           "the captured rows cannot be matched to the dump's requests")
