"""What `Monitor.observe` checks of its arguments before any state changes (a bad one is an
`InputError` naming it), and what counts as an empty step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.types import Alarm
from rlcheck.errors import InputError


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InputError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def check_version(version: Any) -> int | None:
    """`trainer_version`: None, or a non-negative integer."""
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise InputError(f"trainer_version must be a non-negative integer, got {version!r}")
    return int(version)


def check_extra(extra: Mapping[str, float] | None) -> dict[str, float]:
    if not extra:
        return {}
    out = {}
    for key, value in extra.items():
        if not isinstance(key, str) or not key or key.startswith(K.PREFIX):
            raise InputError(f"extra metric name {key!r}: use a non-empty name outside {K.PREFIX!r}")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise InputError(f"extra metric {key!r} must be a number, got {type(value).__name__}") from None
    return out


def is_empty_step(metrics: Mapping[str, float]) -> bool:
    """No token left to compare (every one masked out, or no sequence at all) and none non-finite."""
    return metrics.get(K.TOKEN_COUNT, 0.0) == 0 and metrics.get(K.NONFINITE_COUNT, 0.0) == 0


def check_alarms(alarms: Sequence[Alarm], step: int) -> list[Alarm]:
    """Alarms found outside the Monitor for `step`: Alarm objects of this step."""
    out = list(alarms)
    for a in out:
        if not isinstance(a, Alarm):
            raise InputError(f"alarms must be rlcheck Alarm objects, got {type(a).__name__}")
        if a.step != step:
            raise InputError(f"an alarm for step {a.step} was passed with step {step}")
    return out
