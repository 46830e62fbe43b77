"""A run's quarantine (`rlcheck.core.quarantine` holds the rules): the Monitor's bookkeeping across steps
(the streak of quarantining steps, the recurring bursts, the dump budget; saved in state.json), the
critical `quarantine` alarm, and the dumps of the quarantined sequences (`RUN_DIR/quarantine/step_N/`)."""

from __future__ import annotations

import warnings
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.detect.signature import SignatureConfig
from rlcheck.core.quarantine import MAX_LISTED, QuarantineConfig, Verdict
from rlcheck.core.types import Alarm


class Quarantine:
    """A run's quarantine bookkeeping (the Monitor's, saved in state.json): the streak of steps that
    quarantined a sequence and the dump budget spent."""

    def __init__(self, cfg: QuarantineConfig, signature: SignatureConfig | None = None):
        self.cfg = cfg
        self.signature = signature or SignatureConfig()
        self.streak = 0
        self.dumped = 0
        self.observed = 0
        self.bursts: list[int] = []  # observations whose burst of early divergences passed max_frac

    def step(self, run: Any, step: int, verdict: Verdict, batch: StepBatch | None,
             **dump_args: Any) -> tuple[list[Alarm], dict[str, float], dict[str, Any]]:
        """One observed step's verdict: (its alarms, its metrics, what its record adds), the
        quarantined sequences dumped within the budget."""
        self.streak = self.streak + 1 if verdict.count else 0
        self.observed += 1
        if verdict.burst_only and verdict.frac > self.cfg.max_frac:
            window = self.signature.recur_window
            self.bursts = [o for o in self.bursts if o > self.observed - window] + [self.observed]
        alarms = alarms_of(step, verdict, self.cfg, self.streak, len(self.bursts) if verdict.burst_only else 0,
                           self.signature.recur_count)
        where, written = write_dump(run, step, verdict, batch, self.cfg, self.dumped, **dump_args)
        self.dumped += written
        metrics = {**verdict.metrics(), K.QUARANTINE_UNDUMPED: float(verdict.count - written)}
        record: dict[str, Any] = {"quarantined": record_of(verdict)} if verdict.count else {}
        if where is not None:
            record["quarantine_dump"] = where
        return alarms, metrics, record

    def replay(self, metrics: dict[str, float], alarms: list[dict[str, Any]] = ()) -> None:
        """A step logged by a process that stopped before saving its state (the Monitor's catch-up):
        its record's metrics and alarms."""
        if K.QUARANTINE_COUNT not in metrics:
            return
        count = metrics[K.QUARANTINE_COUNT]
        self.streak = self.streak + 1 if count else 0
        self.dumped += int(count - metrics.get(K.QUARANTINE_UNDUMPED, count))
        self.observed += 1
        if any(a.get("kind") == "quarantine" and a.get("metric") == K.QUARANTINE_FRAC
               and (a.get("details") or {}).get("bursts") for a in alarms):  # a burst past max_frac
            self.bursts = [o for o in self.bursts if o > self.observed - self.signature.recur_window] + [self.observed]

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "dumped": self.dumped, "observed": self.observed, "bursts": self.bursts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak, self.dumped = int(state.get("streak", 0)), int(state.get("dumped", 0))
        self.observed, self.bursts = int(state.get("observed", 0)), [int(o) for o in state.get("bursts", [])]




def write_dump(run: Any, step: int, verdict: Verdict, batch: StepBatch | None, cfg: QuarantineConfig, dumped: int,
               **dump_args: Any) -> tuple[str | None, int]:
    """Write the step's quarantined sequences to quarantine/step_N/ (`Run.write_quarantine`), as many
    as the run's budget (`max_dumped` less the `dumped` so far) allows: (its path or None, how many
    were written). A failed write warns; the step goes on (the record lists every sequence)."""
    room = max(cfg.max_dumped - dumped, 0) if cfg.dump and batch is not None else 0
    picked = verdict.quarantined[:room]
    if not picked:
        return None, 0
    # `batch`: the whole step's, or (across ranks) the quarantined sequences alone, in verdict order
    idx = [q.index for q in picked] if batch.num_sequences != verdict.count else list(range(len(picked)))
    try:
        part = batch if len(idx) == batch.num_sequences else batch.select(idx)
        where = run.write_quarantine(step, part, reason="quarantine", metrics=verdict.metrics(),
                                     quarantined=[q.to_dict() for q in picked], **dump_args)
    except Exception as exc:  # evidence of a step that goes on: say so, lose nothing else
        warnings.warn(f"rlcheck: the quarantine dump of step {step} could not be written ({type(exc).__name__}: "
                      f"{exc}); its sequences are listed in metrics.jsonl", stacklevel=4)
        return None, 0
    return str(where), len(idx)


def alarms_of(step: int, verdict: Verdict, cfg: QuarantineConfig, streak: int, bursts: int = 0,
              recur_count: int = 2) -> list[Alarm]:
    """The critical `quarantine` alarm of a step past `max_frac`, or of the `patience`-th quarantining
    step in a row (`streak` counts this step). A step past `max_frac` only through its burst of early
    divergences (`verdict.burst_only`) is critical once such bursts number `recur_count` (`bursts`,
    this one included, within the signature detector's window), a warning before."""
    if verdict.count == 0:
        return []
    ids = [q.request_id for q in verdict.quarantined[:20]]
    counts = verdict.reason_counts()
    why = ", ".join(f"{n} {r}" for r, n in counts.items() if n)
    details = {"count": verdict.count, "frac": verdict.frac, "max_frac": cfg.max_frac, "streak": streak,
               "reasons": counts, "request_ids": ids}
    num = verdict.keep.shape[0]
    if verdict.frac > cfg.max_frac:
        firm = (verdict.count - verdict.burst_only) / max(num, 1) > cfg.max_frac
        severity = "critical" if firm or bursts >= recur_count else "warn"
        again = "" if firm else (f"; {verdict.burst_only} by the step's burst of early divergences alone, "
                                 f"{bursts} such burst(s) in the signature detector's window (critical at {recur_count})")
        return [Alarm("quarantine", K.QUARANTINE_FRAC, step, severity, (
            f"{verdict.count} of {num} sequences ({verdict.frac:.1%}) would be quarantined ({why}), past max_frac "
            f"{cfg.max_frac:g}: masking that many would hide a broken engine{again}"), {**details, "bursts": bursts})]
    if cfg.patience is not None and streak >= cfg.patience:
        return [Alarm("quarantine", K.QUARANTINE_COUNT, step, "critical", (
            f"sequences quarantined on {streak} steps in a row ({why} this step), patience {cfg.patience}"), details)]
    return []


def record_of(verdict: Verdict) -> list[dict[str, Any]]:
    """The quarantined sequences as the step's record lists them (at most MAX_LISTED)."""
    return [q.to_dict() for q in verdict.quarantined[:MAX_LISTED]]
