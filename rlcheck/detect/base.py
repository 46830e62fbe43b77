"""What every detector shares: the `Alarm` it raises and the `Detector` interface.

A detector is pure: `update(step, metrics) -> list[Alarm]` reads one step's metric dict and its own
history, nothing else; `state_dict()` / `load_state_dict()` round-trip that history through JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcheck.errors import ConfigError

KINDS = ("threshold", "robust_z", "drift", "periodic", "signature")
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


class Detector:
    """Base class: subclasses implement `update` and keep their history JSON-serialisable."""

    kind: str = ""

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:  # pragma: no cover
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError
