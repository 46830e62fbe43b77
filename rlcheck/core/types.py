"""The leaf of types every layer reads: a detector's `Alarm`, a worst sequence (`Offender`) and what
one `Monitor.observe` found (`StepReport`). Nothing of rlcheck's is imported here but its errors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlcheck.errors import ConfigError

KINDS = ("threshold", "robust_z", "drift", "periodic", "signature", "weights")
SEVERITIES = ("info", "warn", "critical")


def severity_rank(severity: str) -> int:
    """0 for info, 1 for warn, 2 for critical."""
    return SEVERITIES.index(severity)


@dataclass(frozen=True)
class Alarm:
    """One finding of one detector at one step."""

    kind: str  # one of KINDS
    metric: str  # the metric key it is about
    step: int
    severity: str  # one of SEVERITIES
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"alarm kind must be one of {KINDS}, got {self.kind!r}")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"alarm severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "metric": self.metric,
            "step": self.step,
            "severity": self.severity,
            "message": self.message,
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Alarm:
        return cls(d["kind"], d["metric"], int(d["step"]), d["severity"], d["message"], dict(d.get("details", {})))


@dataclass(frozen=True)
class Offender:
    """A sequence among the step's worst by max |d|."""

    request_id: str
    index: int  # position of the sequence in the observed batch
    max_abs_diff: float  # over its finite tokens
    first_divergence: int | None  # first token with |d| > divergence_tau (or non-finite); None if none
    length: int
    mean_diff: float  # mean d over its valid tokens
    nonfinite: bool = False

    @property
    def score(self) -> float:
        return math.inf if self.nonfinite else self.max_abs_diff

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "index": self.index,
            "max_abs_diff": self.max_abs_diff,
            "first_divergence": self.first_divergence,
            "length": self.length,
            "mean_diff": self.mean_diff,
            "nonfinite": self.nonfinite,
        }


def rank_offenders(offenders: Sequence[Offender], k: int) -> tuple[Offender, ...]:
    return tuple(sorted(offenders, key=lambda o: (-o.score, o.index))[:k])


@dataclass
class StepReport:
    """What one `observe` call found."""

    step: int
    metrics: dict[str, float]
    alarms: list[Alarm]
    offenders: tuple[Offender, ...]
    halted: bool = False
    halt_reason: str = ""
