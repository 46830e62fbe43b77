"""`rlcheck repro PATH --out DIR`: an engine failure, from a halted run, a dump or a `rlcheck stress`
output, confirmed, shrunk and written up as a standalone reproducer an engine maintainer can run.

    result = repro("runs/demo-x", "runs/repro-x")       # or a dump, or a stress --out directory
    result.verdict        # "reproduced", "nothing", "trainer_side" or "not_reproducible"
    result.shrunk.case    # the minimal case; DIR/repro.py, inputs.json, expected.json, REPORT.md

After the background of the design notes (how vLLM's two silent Mamba bugs were turned into a
failure on demand and handed over), in order:
1. the recorded case (`rlcheck.forensics.repro.source`): the failing step's requests, the engine's
   settings and weights as recorded, its injected fault; a run that never halted, or a stress run with
   no failing request, has nothing to reproduce;
2. confirm: the case in `confirmations` fresh engines, greedy, each judged by the HF reference
   (`rlcheck.forensics.repro.probe`); unless it fails in every one it stops: the engine matching the
   reference while the run's trainer was the side off points at the trainer, anything else is "not
   reproducible outside the run" with what was tried;
3. shrink (`rlcheck.forensics.repro.shrink`): delta debugging over the requests, bisection of their
   lengths, one knob change at a time, until the case is 1-minimal on every axis searched or the
   probe budget is spent;
4. the knob table (`shape`), the first divergent layer and the engine's self-audits (`evidence`);
5. the folder (`files`): repro.py (vLLM, torch and transformers only; an injected fault reaches it
   through rlcheck's vLLM plugin, `RLCHECK_VLLM_FAULT`), inputs.json, expected.json, REPORT.md
   (`report`), repro.json; repro.py is run once to show that it reproduces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcheck.forensics.repro.config import (
    NOT_REPRODUCIBLE,
    NOTHING,
    REPRODUCED,
    TRAINER_SIDE,
    VERDICTS,
    ReproConfig,
    ReproResult,
)
from rlcheck.forensics.repro.probe import ProbeProgress, Prober
from rlcheck.forensics.repro.shrink import SHRINK_AXES, Shrinker
from rlcheck.forensics.repro.source import Source, read_source

__all__ = ["NOTHING", "NOT_REPRODUCIBLE", "REPRODUCED", "SHRINK_AXES", "TRAINER_SIDE", "VERDICTS", "ReproConfig",
           "ReproResult", "repro"]


def repro(path: str | Path, out: str | Path, *, model: str | Path | None = None, config: ReproConfig | None = None,
          progress: ProbeProgress | None = None, log: Callable[[str], None] | None = None) -> ReproResult:
    """Confirm, shrink and write up the engine failure at `path` into `out` (see the module docstring).
    `model`: the model folder (default: the dump's); `progress(phase, probes, budget, case now)`;
    `log(text)`: where the probes' engine errors go."""
    config = config or ReproConfig()
    t0, out = time.perf_counter(), Path(out)
    source = read_source(path, model)
    if source.nothing is not None:
        return _finish(ReproResult(NOTHING, f"nothing to reproduce: {source.nothing}", out, source), t0)
    prober = Prober(source.case.model, config.budget, progress, log)
    confirm = []
    for i in range(config.confirmations):
        confirm.append(prober.run(source.case))
        if progress is not None:
            progress("confirming", i + 1, config.confirmations, f"{source.case.describe()}: {confirm[-1].describe()}")
    prober.cache[source.case.key()] = confirm[0]
    result = ReproResult(NOT_REPRODUCIBLE, "", out, source, sum(p.fails for p in confirm), len(confirm), confirm[0],
                         budget=config.budget)
    t1 = time.perf_counter()
    result.seconds["confirm"] = t1 - t0
    if result.confirmed < result.confirmations:
        return _finish(_unreproduced(result, prober, confirm), t0)
    result.shrunk = Shrinker(prober, config.axes, config.compiled).run(source.case, confirm[0])
    result.probes = prober.used
    t2 = time.perf_counter()
    result.seconds["shrink"] = t2 - t1
    _evidence(result, prober, config)
    result.probes = prober.used
    result.seconds["evidence"] = time.perf_counter() - t2
    result.seconds["probe_engines"] = prober.seconds  # of it, the probes' own engines and reference
    result.diagnosis = _diagnosis(source)
    result.verdict, result.message = REPRODUCED, _reproduced_message(result)
    from rlcheck.forensics.repro.files import write_reproducer

    result.seconds["total"] = time.perf_counter() - t0
    write_reproducer(result, config, prober.scorer_for(result.shrunk.case).model)
    return _finish(result, t0)


def _evidence(result: ReproResult, prober: Prober, config: ReproConfig) -> None:
    from rlcheck.forensics.repro.evidence import audit_case, localize_case
    from rlcheck.forensics.repro.shape import knob_table

    case, probe = result.shrunk.case, result.shrunk.probe
    if config.shape:
        result.table, result.table_note = knob_table(prober, case, probe, compiled=config.compiled)
    if config.evidence:
        result.localized, result.localize_note = localize_case(prober, case, probe)
        result.audits = audit_case(prober, case, probe)


def _unreproduced(result: ReproResult, prober: Prober, confirm: list[Any]) -> ReproResult:
    """The verdict when the recorded case does not fail every time: the trainer's side, or not reproducible."""
    from rlcheck.forensics.repro.evidence import run_sides

    source, case = result.source, result.source.case
    worst = max(p.worst for p in confirm)
    errors = sorted({p.error for p in confirm if p.error is not None})
    result.sides = run_sides(source.sequences, prober.scorer, case.threshold) if source.kind != "stress" else None
    result.diagnosis = _diagnosis(source)
    ran = (f"the recorded case ({case.describe()}) in {result.confirmations} fresh engines failed {result.confirmed} "
           f"time(s)" + (f", the engine erring: {errors[0]}" if errors else f" (max |d| from the reference {worst:.3g}, "
                         f"threshold {case.threshold:g})"))
    lag = _version_lag(source.meta)
    trainer = result.sides is not None and result.sides.side == "trainer"
    if result.confirmed == 0 and not errors and (trainer or lag):
        result.verdict = TRAINER_SIDE
        evidence = "; ".join(([result.sides.describe()] if trainer else []) + ([lag] if lag else []))
        result.message = (f"the engine matches the reference: {ran}. In the run, {evidence}: the mismatch is on the "
                          "trainer's side (what it scored, or the weights it sent), not an engine failure to reproduce"
                          + (f" (diagnose: {result.diagnosis})" if result.diagnosis else "")
                          + ". Look at what the trainer scored and synced: `rlcheck diagnose` on the run, "
                          "`rlcheck replay` on the dump.")
        return result
    tried = "; ".join(source.recorded + ((source.fault_note,) if source.fault_note else ()))
    result.message = f"not reproducible outside the run: {ran}. What was tried: {tried}." + (
        f" In the run, {result.sides.describe()}." if result.sides is not None else "")
    return result


def _version_lag(meta: dict[str, Any]) -> str | None:
    """The dump's weight-version alarm in words (rollouts from weights behind the trainer's), or None."""
    from rlcheck.core import metrics as K

    for alarm in meta.get("alarms") or ():
        if alarm.get("kind") == "weights" and alarm.get("metric") == K.WEIGHTS_MAX_LAG:
            return f"the rollouts came from weights behind the trainer's ({alarm.get('message', '')})"
    return None


def _diagnosis(source: Source) -> str | None:
    if source.run_dir is None:
        return None
    from rlcheck.forensics.diagnose import diagnose

    try:
        verdict = diagnose(source.run_dir).verdict
    except Exception as exc:  # noqa: BLE001 - diagnose's view is a pointer; repro's own verdict stands without it
        return f"diagnose could not read the run: {exc}"
    return f"{verdict.title} (cause {verdict.cause}, confidence {verdict.confidence:.2f})"


def _reproduced_message(result: ReproResult) -> str:
    shrunk, start = result.shrunk, result.source.case
    minimal = "1-minimal" if shrunk.minimal else f"not shown 1-minimal (budget spent in {shrunk.stopped})"
    return (f"reproduced {result.confirmed} of {result.confirmations}; shrunk from {start.describe()} to "
            f"{shrunk.case.describe()} ({minimal}, {result.probes} probes): {result.out / 'repro.py'}")


def _finish(result: ReproResult, t0: float) -> ReproResult:
    from rlcheck.forensics.repro.files import write_result

    result.seconds = {**result.seconds, "total": time.perf_counter() - t0}
    write_result(result)
    return result
