"""`rlcheck localize PATH`: the decoder layer where a logprob divergence starts.

    result = localize("runs/stress-x", top=10)      # also writes runs/stress-x/localize.json and .png
    r = result.requests[0]
    r.first_divergent_layer, r.layer_type, r.position, r.response_position, r.layers

For the worst requests of a dump (largest max |logp_train - logp_rollout|, or `request_ids`), the
engine's hidden state after every decoder layer, captured inside vLLM at every prefill and decode
step (`rlcheck.forensics.localize.capture`), is compared with the HF reference's at every position
(`rlcheck.forensics.localize.compare`: the measure, the tolerances, what `position` counts).

How the engine side is re-run depends on PATH:
- a `rlcheck stress --out` directory (stress.json beside the dump): the whole workload again, every
  prompt in arrival order, with the run's engine settings (dtype, seed, max_num_seqs, cache budget,
  batched tokens, greedy) and its fault re-injected (stale-state, index-wrap, perturb-layer): the same
  schedule, slots and tokens, so a fault of the schedule happens again to the same requests. Only the
  chosen requests' rows are kept; their re-run tokens are checked against the dump's.
- any other dump: the chosen requests alone, teacher-forced (prompt + response but its last token, one
  prefill each), with the dump's engine settings (context.engine, `rlcheck.core.run.context`: the dtype
  it ran, its cache budget, max_num_seqs) and its engine fault (context.fault) re-injected. A weight or kernel fault shows; a fault of the
  schedule only if the small re-run triggers it; the weights are the model folder's (a run's later,
  synced weights are not in the dump).
An injected fault is re-injected because it is part of the engine under test; a real engine bug is
reproduced by the re-run itself. `engine=`: an engine already started with those settings (and the
fault): localize uses it as it is and leaves it open. The re-runs: `rlcheck.forensics.localize.engine`.

On an MoE model the same re-run records which experts the engine's routers picked at every position
(`RouteCapture`), the reference's forward its own (`RouteRecorder`), and `r.routing` names the first MoE
layer where they differ, with how many tokens (`rlcheck.forensics.localize.routing`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.run.context import read_context
from rlcheck.engines.reference import ReferenceConfig
from rlcheck.errors import InputError
from rlcheck.forensics.localize.compare import (
    LocalizeResult,
    RequestLocalization,
    localize_request,
    relative_errors,
    tolerance_for,
)
from rlcheck.forensics.localize.engine import EngineRun, dump_fault, fault_name, rerun_forced, rerun_stress
from rlcheck.forensics.localize.routing import compare_routing, moe_layers, reference_routes
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
    fault: str | None = None,
    reference: ReferenceConfig | None = None,
    progress: Progress | None = None,
    scorer: Any = None,
    engine: Any = None,
    write: bool = True,
) -> LocalizeResult:
    """Localize the divergence of the worst `top` requests of a dump or stress output (or of
    `request_ids`); see the module docstring. `tolerance`: None takes the looser of the engine's dtype
    (as the dump records it; the loosest when it does not) and the reference's. `fault`: the engine
    fault to re-inject in a teacher-forced re-run instead of the dump's ("none": none). `reference`:
    where and in what dtype the HF reference runs (`ReferenceConfig`; default float32 on CPU).
    `write`: localize.json and localize.png into PATH."""
    if tolerance is not None and not tolerance > 0:
        raise InputError(f"tolerance must be > 0, got {tolerance}")
    reference = reference or ReferenceConfig()
    t0 = time.perf_counter()
    dump = check_dump_dir(path)
    seqs = load_sequences(dump)
    model_dir = resolve_model(seqs.meta, model_dir)
    chosen = choose(seqs, request_ids, top)
    stress = stress_config(dump, model_dir)
    dtype = stress.dtype if stress is not None else engine_dtype(seqs.meta)
    forced_fault = None if stress is not None else dump_fault(seqs.meta, fault)
    tol, tol_from = (tolerance, "argument") if tolerance is not None else (_tolerance(dtype, reference.dtype), "dtype")
    scorer = scorer or load_scorer(model_dir, reference)
    check_vocab(seqs, vocab_size(scorer.model))
    model_type = str(scorer.model.config.model_type)
    moe = moe_layers(scorer.model)  # decoder layer of each MoE layer: its routing is compared too
    t1 = time.perf_counter()
    if stress is not None:
        mode, fault_run = "stress re-run", fault_name(stress)
        runs = rerun_stress(stress, seqs, chosen, model_type, engine, progress, moe=bool(moe))
    else:
        mode, fault_run = "teacher-forced prefill", forced_fault.name
        runs = rerun_forced(seqs, chosen, model_dir, model_type, dtype, engine, progress, moe=bool(moe),
                            fault=forced_fault)
    t2 = time.perf_counter()
    from rlcheck.forensics.localize.capture import layer_types

    types = layer_types(scorer.model)
    requests = []
    for i in chosen:
        requests.append(_compare(seqs, i, runs[i], scorer.model, types, tol, stress is not None, moe))
        if progress is not None:
            progress("reference and comparison (requests)", len(requests), len(chosen))
    result = LocalizeResult(
        path=str(dump), model=str(model_dir), dtype=dtype, tolerance=tol, tolerance_from=tol_from, mode=mode,
        fault=fault_run, layer_types=types, requests=tuple(requests),
        seconds={"load": t1 - t0, "engine": t2 - t1, "reference": time.perf_counter() - t2})
    if write:
        from rlcheck.forensics.localize.report import PLOT_FILE, plot_localization

        try:
            result = replace(result, plot=str(plot_localization(result, dump / PLOT_FILE)))
        except ImportError:  # no matplotlib: the table and the JSON still come
            pass
        result.write(dump)
    return result


def engine_dtype(meta: dict[str, Any]) -> str:
    """The dtype the dump's engine ran (`rlcheck.core.run.context`); else the one it was configured
    with; "auto" when neither says (vLLM then picks the checkpoint's dtype again in the re-run, and the
    tolerance is the loosest)."""
    engine = read_context(meta).engine
    return engine.precision or str(engine.configured_dtype or "auto")


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
    from rlcheck.forensics.stress.config import StressConfig
    from rlcheck.forensics.stress.report import RESULT_FILE

    if not (dump / RESULT_FILE).is_file():
        return None
    try:
        config = json.loads((dump / RESULT_FILE).read_text())["config"]
        return replace(StressConfig(**config), model=str(model_dir), guard=False, audits=())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{dump / RESULT_FILE} does not hold a stress run's settings ({exc}); "
                         "is it rlcheck stress output?") from exc


def _tolerance(*dtypes: str) -> float:
    try:
        return tolerance_for(*dtypes)
    except ValueError as exc:
        raise InputError(str(exc)) from None


# ---- the reference and the comparison ------------------------------------------------------------


def _compare(seqs: DumpSequences, i: int, run: EngineRun, model: Any, types: tuple[str, ...], tolerance: float,
             decoded: bool, moe: tuple[int, ...]) -> RequestLocalization:
    from rlcheck.forensics.localize.capture import reference_states

    prompt, response = seqs.prompts[i], run.tokens
    rid = seqs.request_ids[i]
    match = list(response) == list(seqs.responses[i])
    note = None if match else _mismatch(seqs.responses[i], response)
    if run.positions.size == 0:
        return localize_request(rid, np.zeros((len(types), 0)), types, len(prompt), tolerance,
                                tokens_match=match, note="the engine computed no position of this request")
    with reference_routes(model, run.experts is not None) as routes:
        reference = reference_states(model, prompt + list(response[:-1]))  # what the engine ran
    routing = None if routes is None else compare_routing(
        run.positions, run.experts, routes.experts(), moe, len(prompt),
        in_dump=None if seqs.first_route_diff is None else seqs.first_route_diff[i])
    rel = relative_errors(run.states, reference[:, run.positions])
    return localize_request(rid, rel, types, len(prompt), tolerance, positions=run.positions, decoded=decoded,
                            tokens_match=match, note=note, routing=routing)


def _mismatch(dumped: list[int], rerun: list[int]) -> str:
    at = next((k for k, (a, b) in enumerate(zip(dumped, rerun, strict=False)) if a != b), min(len(dumped), len(rerun)))
    return (f"the re-run generated other tokens than the dump from response token {at} on; "
            "compared on the re-run's tokens")
