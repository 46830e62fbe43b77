"""What every detector shares: the `Alarm` it raises and the `Detector` interface.

A detector is pure: `update(step, metrics) -> list[Alarm]` reads one step's metric dict and its own
history, nothing else; `state_dict()` / `load_state_dict()` round-trip that history through JSON.
"""

from __future__ import annotations

from typing import Any

from rlcheck.core.types import KINDS, SEVERITIES, Alarm, severity_rank

__all__ = ["KINDS", "SEVERITIES", "Alarm", "Detector", "severity_rank"]

class Detector:
    """Base class: subclasses implement `update` and keep their history JSON-serialisable."""

    kind: str = ""
    scale: float = 1.0
    """The run's precision floor over the bf16 floor the defaults were set at (`rlcheck.core.floors`),
    set by the Monitor: the levels a detector calls noise scale with it (1e-3 on a fp32/fp32 run)."""

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:  # pragma: no cover
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError
