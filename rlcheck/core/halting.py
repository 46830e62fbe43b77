"""The halt policy (`HaltConfig`) over the stream of alarms: the hard limits' critical alarms (and a
NaN/inf logprob's, always), `weights` and `quarantine` alarms halt at once; other qualifying alarms (kind in `kinds`, severity at least
`min_severity`) halt once they have come `patience` observed steps in a row. An empty step without a
qualifying alarm neither extends nor breaks the streak. Halting off, the hard limits still alarm."""

from __future__ import annotations

from rlcheck.core import metrics as K
from rlcheck.core.config import HaltConfig
from rlcheck.core.types import Alarm, StepReport, severity_rank


class HaltPolicy:
    """`HaltConfig` applied step by step; `streak` is its state (saved in state.json)."""

    def __init__(self, cfg: HaltConfig):
        self.cfg = cfg
        self.streak = 0

    def hard_limit_alarms(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        """Critical alarms of the hard limits, and of any NaN/inf logprob whatever `hard_limits` holds
        (a NaN is never a matter of taste); raised with halting on or off, they halt at once when on."""
        out = []
        nonfinite = metrics.get(K.NONFINITE_COUNT, 0.0)
        if nonfinite > 0:
            out.append(Alarm(
                "threshold", K.NONFINITE_COUNT, step, "critical",
                f"{K.NONFINITE_COUNT} = {nonfinite:.4g}: NaN/inf logprobs, always critical",
                {"value": nonfinite, "limit": 0.0, "hard_limit": True},
            ))
        for key, limit in self.cfg.hard_limits.items():
            if key == K.NONFINITE_COUNT and nonfinite > 0:
                continue  # the alarm above says it
            value = metrics.get(key)
            if value is not None and not value <= limit:  # NaN is past any limit
                out.append(Alarm(
                    "threshold", key, step, "critical",
                    f"{key} = {value:.4g} is past the hard limit {limit:g}",
                    {"value": value, "limit": limit, "hard_limit": True},
                ))
        return out

    def qualifying(self, alarms: list[Alarm]) -> list[Alarm]:
        h = self.cfg
        return [a for a in alarms if a.kind in h.kinds and severity_rank(a.severity) >= severity_rank(h.min_severity)]

    def advance(self, alarms: list[Alarm], empty: bool = False) -> None:
        """One observed step's effect on the streak."""
        if self.cfg.enabled:
            if self.qualifying(alarms):
                self.streak += 1
            elif not empty:
                self.streak = 0

    def decide(self, report: StepReport, hard: list[Alarm]) -> None:
        """After `advance`: mark `report` halted when the policy says so. A `weights` alarm (a
        sequence from weights past the allowed lag) and a `quarantine` alarm (too much to mask)
        halt at once, like a hard limit."""
        if not self.cfg.enabled:
            return
        hard = hard + [a for a in report.alarms if a.kind in ("weights", "quarantine") and a.kind in self.cfg.kinds
                       and a.severity == "critical"]
        if hard:
            report.halted, report.halt_reason = True, hard[0].message
        elif self.streak >= self.cfg.patience and self.qualifying(report.alarms):
            first = self.qualifying(report.alarms)[0]
            report.halted = True
            report.halt_reason = f"{first.kind} alarm on {first.metric}: {first.message}"
