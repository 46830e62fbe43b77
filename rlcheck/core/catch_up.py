"""A resuming Monitor's catch-up: the metrics.jsonl lines a killed process logged after its last state
save are fed to the detectors again (their metrics are exactly what its detectors saw), so no step
is lost or repeated."""

from __future__ import annotations

from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.types import Alarm


def catch_up(mon: Any, committed: int | None) -> str:
    """Feed the detectors the metrics.jsonl lines a killed process logged after its last state
    save (their metrics are exactly what its detectors saw), so no step is lost or repeated; say
    what was replayed (for the resume warning)."""
    records = mon.run.uncommitted(committed)
    replayed = []
    added_after = (K.ALARM_COUNT, K.MONITOR_SECONDS)  # and the caller's extra keys, outside the prefix
    for rec in records:
        if not isinstance(rec.get("step"), int) or not isinstance(rec.get("metrics"), dict):
            continue
        seen = {k: v for k, v in rec["metrics"].items() if k.startswith(K.PREFIX) and k not in added_after}
        empty = rec.get("empty") is True
        for det in mon.detectors.values() if not empty else ():
            det.update(rec["step"], seen)
        mon.advance(rec["step"], [Alarm.from_dict(a) for a in rec.get("alarms") or ()], empty)
        if mon.quarantine is not None:
            mon.quarantine.replay(rec["metrics"], rec.get("alarms") or [])
        replayed.append(rec["step"])
    if not (replayed or records.num_skipped):
        return ""
    torn = f"; {records.num_skipped} line(s) cut short were skipped" if records.num_skipped else ""
    return (f": metrics.jsonl held step(s) {replayed} logged after the last state save (the previous "
            f"process stopped in between){torn}; the detectors caught up")
