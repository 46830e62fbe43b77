"""`rlcheck localize PATH`: the decoder layer where a logprob divergence starts.

    result = localize("runs/stress-x", top=10)      # also writes runs/stress-x/localize.json and .png
    r = result.requests[0]
    r.first_divergent_layer, r.layer_type, r.position, r.response_position, r.layers

For the worst requests of a dump (largest max |logp_train - logp_rollout|, or `request_ids`), the
engine's hidden state after every decoder layer, captured inside vLLM at every prefill and decode
step (`rlcheck.forensics.localize_vllm`), is compared with the HF reference's at every position
(`rlcheck.forensics.localize_compare`: the measure, the tolerances, what `position` counts).

How the engine side is re-run depends on PATH:
- a `rlcheck stress --out` directory (stress.json beside the dump): the whole workload again, every
  prompt in arrival order, with the run's engine settings (dtype, seed, max_num_seqs, cache budget,
  batched tokens, greedy) and its fault re-injected (stale-state, index-wrap, perturb-layer): the same
  schedule, slots and tokens, so a fault of the schedule happens again to the same requests. Only the
  chosen requests' rows are kept; their re-run tokens are checked against the dump's.
- any other dump: the chosen requests alone, teacher-forced (prompt + response but its last token, one
  prefill each), with the dump's engine settings (context.engine: dtype, cache budget, max_num_seqs)
  and its engine fault (context.fault) re-injected. A weight or kernel fault shows; a fault of the
  schedule only if the small re-run triggers it; the weights are the model folder's (a run's later,
  synced weights are not in the dump).
An injected fault is re-injected because it is part of the engine under test; a real engine bug is
reproduced by the re-run itself. `engine=`: an engine already started with those settings (and the
fault): localize uses it as it is and leaves it open.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.errors import InputError
from rlcheck.forensics.localize_compare import (
    LocalizeResult,
    RequestLocalization,
    localize_request,
    relative_errors,
    tolerance_for,
)
from rlcheck.forensics.replay import (
    DumpSequences,
    check_dump_dir,
    check_vocab,
    load_scorer,
    load_sequences,
    resolve_model,
    vocab_size,
)

DEFAULT_TOP = 10
"""Requests localized when none are named: the worst ten."""
Progress = Callable[[str, int, int], None]  # (phase, done, total)


def localize(
    path: str | Path,
    model_dir: str | Path | None = None,
    *,
    request_ids: Sequence[str] | None = None,
    top: int = DEFAULT_TOP,
    tolerance: float | None = None,
    progress: Progress | None = None,
    scorer: Any = None,
    engine: Any = None,
    write: bool = True,
) -> LocalizeResult:
    """Localize the divergence of the worst `top` requests of a dump or stress output (or of
    `request_ids`); see the module docstring. `write`: localize.json and localize.png into PATH."""
    if tolerance is not None and not tolerance > 0:
        raise InputError(f"tolerance must be > 0, got {tolerance}")
    t0 = time.perf_counter()
    dump = check_dump_dir(path)
    seqs = load_sequences(dump)
    model_dir = resolve_model(seqs.meta, model_dir)
    chosen = choose(seqs, request_ids, top)
    stress = stress_config(dump, model_dir)
    dtype = stress.dtype if stress is not None else _engine_settings(seqs.meta).get("dtype") or "float32"
    tol, tol_from = (tolerance, "argument") if tolerance is not None else (_tolerance(dtype), "dtype")
    scorer = scorer or load_scorer(model_dir)
    check_vocab(seqs, vocab_size(scorer.model))
    model_type = str(scorer.model.config.model_type)
    t1 = time.perf_counter()
    if stress is not None:
        mode, fault = "stress re-run", _fault_name(stress)
        runs = _rerun_stress(stress, seqs, chosen, model_type, engine, progress)
    else:
        mode, fault = "teacher-forced prefill", _dump_fault(seqs.meta)
        runs = _rerun_forced(seqs, chosen, model_dir, model_type, dtype, engine, progress)
    t2 = time.perf_counter()
    from rlcheck.forensics.localize_vllm import layer_types

    types = layer_types(scorer.model)
    requests = []
    for i in chosen:
        requests.append(_compare(seqs, i, runs[i], scorer.model, types, tol, stress is not None))
        if progress is not None:
            progress("reference and comparison (requests)", len(requests), len(chosen))
    result = LocalizeResult(
        path=str(dump), model=str(model_dir), dtype=dtype, tolerance=tol, tolerance_from=tol_from, mode=mode,
        fault=fault, layer_types=types, requests=tuple(requests),
        seconds={"load": t1 - t0, "engine": t2 - t1, "reference": time.perf_counter() - t2})
    if write:
        from rlcheck.forensics.localize_report import PLOT_FILE, plot_localization

        try:
            result = replace(result, plot=str(plot_localization(result, dump / PLOT_FILE)))
        except ImportError:  # no matplotlib: the table and the JSON still come
            pass
        result.write(dump)
    return result


def choose(seqs: DumpSequences, request_ids: Sequence[str] | None, top: int) -> list[int]:
    """Indices of the requests to localize: `request_ids` (each must be in the dump) in that order,
    else the `top` with the largest max |logp_train - logp_rollout| over the tokens the mask keeps
    (non-finite first), worst first."""
    if request_ids:
        where = {rid: i for i, rid in enumerate(seqs.request_ids)}
        missing = [rid for rid in request_ids if rid not in where]
        if missing:
            some = ", ".join(seqs.request_ids[:5]) + (", ..." if len(seqs.request_ids) > 5 else "")
            raise InputError(f"request id(s) {', '.join(map(repr, missing))} not in the dump (it has {some})")
        return list(dict.fromkeys(where[rid] for rid in request_ids))
    if top < 1:
        raise InputError(f"top must be >= 1, got {top}")
    score = np.zeros(len(seqs.request_ids))
    if seqs.logp_train is not None:
        for i, (a, b) in enumerate(zip(seqs.logp_rollout, seqs.logp_train, strict=True)):
            d = np.abs(np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64))
            d = np.where(np.isnan(d), np.inf, d)
            score[i] = (d if seqs.valid is None else d[seqs.valid[i]]).max(initial=0.0)  # masked-out tokens never count
    return [int(i) for i in np.argsort(-score, kind="stable")[:top]]


def stress_config(dump: Path, model_dir: Path) -> Any:
    """The `StressConfig` of a `rlcheck stress --out` directory (its stress.json), on `model_dir`; None
    for another dump."""
    from rlcheck.forensics.stress_config import StressConfig
    from rlcheck.forensics.stress_report import RESULT_FILE

    if not (dump / RESULT_FILE).is_file():
        return None
    try:
        config = json.loads((dump / RESULT_FILE).read_text())["config"]
        return replace(StressConfig(**config), model=str(model_dir), guard=False, audits=())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{dump / RESULT_FILE} does not hold a stress run's settings ({exc}); "
                         "is it rlcheck stress output?") from exc


def _engine_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """The dump's context.engine (dtype, kv_cache_bytes, max_num_seqs, ...; {} without one)."""
    settings = (meta.get("context") or {}).get("engine")
    return settings if isinstance(settings, dict) else {}


def _tolerance(dtype: str) -> float:
    try:
        return tolerance_for(dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _fault_name(cfg: Any) -> str:
    value = cfg.fault_boundary if cfg.fault == "index-wrap" else cfg.layer
    return cfg.fault + ("" if value is None else f"={value}")


def _dump_fault(meta: dict[str, Any]) -> str:
    """The engine fault a dump's run had (context.fault, as `rlcheck demo --inject` wrote it), or "none"."""
    spec = (meta.get("context") or {}).get("fault")
    if not spec or spec == "none":
        return "none"
    from rlcheck.engines.vllm_faults import FAULTS
    from rlcheck.faults import parse_inject

    try:
        engine_fault = parse_inject(str(spec)).engine_fault()
    except Exception:  # noqa: BLE001 - a fault this version does not know: nothing to re-inject
        return "none"
    if engine_fault is None or engine_fault[0] not in FAULTS:
        return "none"
    kind, options = engine_fault
    return kind + "".join(f"={v}" for v in options.values())


# ---- the engine side -----------------------------------------------------------------------------


Run = tuple[np.ndarray, np.ndarray, list[int]]  # positions (T,), states (L, T, H), the tokens the engine ran


def _rerun_stress(cfg: Any, seqs: DumpSequences, chosen: list[int], model_type: str, engine: Any,
                  progress: Progress | None) -> dict[int, Run]:
    """The stress workload again (see the module docstring); the chosen requests' layer states."""
    from rlcheck.forensics.localize_vllm import LayerCapture
    from rlcheck.forensics.stress import inject_faults, progress_bar, start_engine

    own = engine is None
    engine = engine or start_engine(cfg)
    handles: tuple[Any, ...] = inject_faults(engine, cfg)[:2] if own else ()
    try:
        offset = engine.llm.request_counter.counter  # vLLM numbers this engine's requests from here
        ids = {str(offset + i): i for i in chosen}
        bar = None if progress is None else progress_bar(lambda d, t: progress("re-running in vLLM (requests)", d, t))
        with LayerCapture(engine, ids, model_type) as capture:
            rollouts = engine.generate(seqs.prompts, step=0, use_tqdm=bar or False)
        _check_ids([r.vllm_request_id for r in rollouts], offset)
        return {i: (*capture.states(rid), list(rollouts[i].token_ids)) for rid, i in ids.items()}
    finally:
        for h in handles:
            if h is not None:
                h.remove()
        if own:
            engine.close()


def _rerun_forced(seqs: DumpSequences, chosen: list[int], model_dir: Path, model_type: str, dtype: str,
                  engine: Any, progress: Progress | None) -> dict[int, Run]:
    """The chosen requests teacher-forced, one prefill each (see the module docstring)."""
    from rlcheck.forensics.localize_vllm import LayerCapture
    from rlcheck.forensics.stress import progress_bar

    forced = [seqs.prompts[i] + seqs.responses[i][:-1] for i in chosen]
    own = engine is None
    engine = engine or _forced_engine(seqs.meta, model_dir, dtype, max(len(f) for f in forced) + 1)
    handle = _inject_dump_fault(engine, seqs.meta) if own else None
    try:
        llm = getattr(engine, "llm", engine)  # a VLLMEngine or a vllm.LLM
        offset = llm.request_counter.counter
        ids = {str(offset + k): i for k, i in enumerate(chosen)}
        bar = None if progress is None else progress_bar(lambda d, t: progress("re-running in vLLM (requests)", d, t))
        from vllm import SamplingParams

        one = SamplingParams(max_tokens=1, temperature=0.0)  # the prefill is what counts; its one token is not
        with LayerCapture(engine, ids, model_type) as capture:
            outputs = llm.generate([{"prompt_token_ids": f} for f in forced], one, use_tqdm=bar or False)
        _check_ids([str(o.request_id) for o in outputs], offset)
        return {i: (*capture.states(rid), list(seqs.responses[i])) for rid, i in ids.items()}
    finally:
        if handle is not None:
            handle.remove()
        if own:
            engine.close()


def _forced_engine(meta: dict[str, Any], model_dir: Path, dtype: str, max_len: int) -> Any:
    """A greedy one-token engine with the dump's engine settings, long enough for its sequences,
    hookable (localize hooks every decoder layer; a dump's engine fault is injected into it)."""
    from rlcheck.engines.vllm import VLLMConfig, VLLMEngine
    from rlcheck.errors import ConfigError

    settings = _engine_settings(meta)
    cfg = VLLMConfig(model=str(model_dir), dtype=dtype, greedy=True, max_tokens=1, engine_id="localize",
                     max_model_len=max(256, max_len), kv_cache_bytes=settings.get("kv_cache_bytes") or 64 << 20,
                     max_num_seqs=settings.get("max_num_seqs"), hookable=True)
    try:
        return VLLMEngine(cfg)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"vLLM refused the dump's engine settings: {str(exc).splitlines()[0]}") from exc


def _inject_dump_fault(engine: Any, meta: dict[str, Any]) -> Any:
    spec = _dump_fault(meta)
    if spec == "none":
        return None
    from rlcheck.engines import vllm_faults
    from rlcheck.faults import parse_inject

    kind, options = parse_inject(str(meta["context"]["fault"])).engine_fault()
    return vllm_faults.inject(engine, kind, **options)


def _check_ids(got: list[str], offset: int) -> None:
    if got != [str(offset + i) for i in range(len(got))]:
        raise RuntimeError(f"vLLM numbered the re-run's requests {got[:4]}..., not from {offset}: "
                           "the captured rows cannot be matched to the dump's requests")


# ---- the reference and the comparison ------------------------------------------------------------


def _compare(seqs: DumpSequences, i: int, run: Run, model: Any, types: tuple[str, ...], tolerance: float,
             decoded: bool) -> RequestLocalization:
    from rlcheck.forensics.localize_vllm import reference_states

    positions, states, response = run
    prompt = seqs.prompts[i]
    rid = seqs.request_ids[i]
    match = list(response) == list(seqs.responses[i])
    note = None if match else _mismatch(seqs.responses[i], response)
    if positions.size == 0:
        return localize_request(rid, np.zeros((len(types), 0)), types, len(prompt), tolerance,
                                tokens_match=match, note="the engine computed no position of this request")
    reference = reference_states(model, prompt + list(response[:-1]))  # what the engine ran
    rel = relative_errors(states, reference[:, positions])
    return localize_request(rid, rel, types, len(prompt), tolerance, positions=positions, decoded=decoded,
                            tokens_match=match, note=note)


def _mismatch(dumped: list[int], rerun: list[int]) -> str:
    at = next((k for k, (a, b) in enumerate(zip(dumped, rerun, strict=False)) if a != b), min(len(dumped), len(rerun)))
    return (f"the re-run generated other tokens than the dump from response token {at} on; "
            "compared on the re-run's tokens")
