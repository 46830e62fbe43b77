"""The engine guard's violations as Monitor alarms: `violations_to_alarms` turns one step's violations
(`Violation`s or their dicts) into one "signature" alarm per check, on the metric GUARD_METRIC with
signature SIGNATURE, its evidence (request ids, engine steps, slots, the first violation) in
`details`; `guard_alarms` adds, to those of one guard report, the alarm of a guard that died
(`dead_guard_alarm`); the loop raises them with the step's other alarms. `rlcheck.engines.guard`
re-exports them.
"""

from __future__ import annotations

from typing import Any

from rlcheck.core.run.guard_record import INVARIANT, Violation

GUARD_METRIC = "guard/violations"
"""The metric a guard alarm is about (the loop may log it as an extra scalar: violations per step)."""
SIGNATURE = "engine_guard"
"""`details["signature"]` of the alarms `violations_to_alarms` makes."""
DEAD_SIGNATURE = "engine_guard_dead"
"""`details["signature"]` of the alarm of a guard that died (`dead_guard_alarm`)."""
ALIVE_METRIC = "guard/alive"
"""1 while the guard traces the engine's steps, 0 once it died."""
SKIPPED_METRIC = "guard/skipped_steps"
"""Engine steps with work scheduled that the guard could not trace (micro-batched metadata), so far."""


def violations_to_alarms(step: int, violations: list[Any], severity: str = "critical") -> list[Any]:
    """The Monitor alarms of one step's guard violations (`Violation`s or their dicts): one per check,
    kind "signature" (signature SIGNATURE), its evidence in `details`."""
    from rlcheck.core.types import Alarm

    by_check: dict[str, list[dict[str, Any]]] = {}
    for v in violations:
        d = v.to_dict() if isinstance(v, Violation) else dict(v)
        by_check.setdefault(d["check"], []).append(d)
    alarms = []
    for check, ds in by_check.items():
        ids = list(dict.fromkeys(d.get("rollout_request_id") or d["request_id"] for d in ds))
        first, invariant = ds[0], INVARIANT[check]
        alarms.append(Alarm("signature", GUARD_METRIC, step, severity, (
            f"engine guard {invariant} {check}: {len(ids)} request(s), first {first['message']}"), {
            "signature": SIGNATURE, "check": check, "invariant": invariant, "request_ids": ids[:50],
            "engine_steps": sorted({d["step"] for d in ds})[:50],
            "slots": sorted({d["slot"] for d in ds if d.get("slot") is not None})[:50],
            "num_violations": len(ds), "first": first}))
    return alarms


def dead_guard_alarm(step: int, error: str, trace: str | None = None) -> Any:
    """The alarm of a guard that died at or before `step`: warn (the run goes on, unguarded), kind
    "signature" (signature DEAD_SIGNATURE), the exception and its traceback in `details`."""
    from rlcheck.core.types import Alarm

    return Alarm("signature", ALIVE_METRIC, step, "warn",
                 f"the engine guard stopped (its own error, not the engine's): {error}; the engine's invariants are "
                 "not checked from here on", {"signature": DEAD_SIGNATURE, "error": error, "traceback": trace})


def guard_alarms(step: int, report: dict[str, Any]) -> list[Any]:
    """The alarms of one `take_report` (`VLLMEngine.take_guard_report`): the violations', and a dead
    guard's the first time its error is reported."""
    alarms = violations_to_alarms(step, report["violations"])
    if report.get("error"):
        alarms.append(dead_guard_alarm(step, report["error"], report.get("error_trace")))
    return alarms
