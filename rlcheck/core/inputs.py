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
"""From this many compared tokens on, bitwise-equal sides are worth a note (`identical_sides`): a
real recompute matches bitwise only on a batch-invariant, deterministic setup (vLLM fp32 against HF
fp32 differs by ~1e-6), and a copy of the rollout side handed as the trainer's would read the same."""


def identical_sides(metrics: Mapping[str, float]) -> bool:
    """True when the two sides are value-equal on every compared token (at least MIN_IDENTICAL_TOKENS
    of them, none non-finite): the best agreement there is (a true on-policy engine: batch-invariant
    kernels, deterministic inference), or a copy of the rollout side. rlcheck refuses the copies it can
    see (one buffer passed as both sides: `rlcheck.core.batch_build.two_sides`; verl's bypass mode at
    attach, `rlcheck.integrations.verl.preflight`), so the Monitor takes this as health, with one note."""
    count = metrics.get(K.TOKEN_COUNT, 0.0)
    return (count >= MIN_IDENTICAL_TOKENS and not metrics.get(K.NONFINITE_COUNT, 0.0)
            and metrics.get(K.ABS_DIFF_MAX, 1.0) == 0)


IDENTICAL_NOTE = (
    "rlcheck: logp_rollout and logp_train agree bitwise on all {count:.0f} compared tokens of step {step}: the best "
    "agreement there is (a true on-policy setup: batch-invariant kernels, deterministic inference). If the trainer "
    "side is instead a copy of the rollout side (verl's bypass mode through a transfer queue, the engine's "
    "logprobs passed twice), nothing is measured: pass the trainer's own recompute. Declare a true on-policy run "
    "with MonitorConfig(true_on_policy=True): then any difference at all is a critical alarm. (Said once.)")


def exact_alarms(step: int, metrics: Mapping[str, float]) -> list[Alarm]:
    """A run declared true on-policy (`MonitorConfig.true_on_policy`): a critical alarm on any token where
    the sides differ at all (a hard limit of 0 on `rlcheck/token/abs_diff_max`)."""
    value = metrics.get(K.ABS_DIFF_MAX, 0.0)
    if not value > 0:
        return []
    return [Alarm("threshold", K.ABS_DIFF_MAX, step, "critical",
                  f"{K.ABS_DIFF_MAX} = {value:.4g}: the run is declared true on-policy (MonitorConfig.true_on_policy) "
                  "and its two sides differ", {"value": value, "limit": 0.0, "hard_limit": True})]
