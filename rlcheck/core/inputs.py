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


MIN_IDENTICAL_TOKENS = 16
"""Below this many compared tokens, bitwise-equal sides may be legitimate (a saturated model's 0.0
logprobs on a short step); from it on, a real recompute never matches bitwise (vLLM fp32 against HF
fp32 differs by ~1e-6), so equal sides mean the trainer side is a copy of the rollout side."""


def check_sides_differ(metrics: Mapping[str, float]) -> None:
    """Raise when the two sides are value-equal on every compared token: the statistics would read
    "abs_diff_max 0, healthy" while nothing was measured. An InputError rather than an alarm: no
    step of such a run can ever be judged, so the run's setup is wrong, not the step."""
    count = metrics.get(K.TOKEN_COUNT, 0.0)
    if count < MIN_IDENTICAL_TOKENS or metrics.get(K.NONFINITE_COUNT, 0.0) or metrics.get(K.ABS_DIFF_MAX, 1.0) != 0:
        return
    raise InputError(
        f"logp_rollout and logp_train are identical on all {count:.0f} compared tokens (abs_diff_max 0): the "
        "trainer side is a copy of the rollout side, not the trainer's own recompute, so there is no mismatch "
        "to measure. verl bypass mode (algorithm.rollout_correction.bypass_mode=True) writes rollout_log_probs "
        "into old_log_probs: turn it off; elsewhere pass the logprobs the trainer computed itself"
    )


def check_metrics(metrics: Mapping[str, float]) -> bool:
    """A step's finalized metrics before the detectors see them: raises for value-equal sides
    (`check_sides_differ`); True when the step is empty (`is_empty_step`)."""
    check_sides_differ(metrics)
    return is_empty_step(metrics)
