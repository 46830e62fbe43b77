"""What "clean" means for the run diagnose reads: its precision floor (`rlcheck.core.floors`), as the
Monitor logged it in every record (`rlcheck/floor/level`), else as the dump's or run's context names
the two sides' dtypes, else the fp32 floor the rules were first written at.

The rules' `rows.CLEAN` (1e-4: 100x the fp32 agreement of the two sides) is 10x the fp32 floor's
level; `clean_level` keeps that ratio at the run's floor: 1e-4 on fp32/fp32, 0.1 on a bf16 engine
(whose healthy rows sit at 1e-2 with a tail to 0.2 on the tiny trained Llama). A rule's "off" group
must pass it and its contrast with the clean rows; a fault smaller than the precision's noise cannot
(a prefix cached one update ago, 1e-4 nats apart, is invisible beside a bf16 engine's 1e-2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.detect.threshold import DEFAULT_RULES
from rlcheck.core.floors import LEVELS, Precision, scale_of
from rlcheck.forensics.diagnose.queries import metric_series
from rlcheck.forensics.diagnose.rows import CLEAN

CLEAN_RATIO = CLEAN / LEVELS["float32"]
"""The clean level over the floor's level (10: CLEAN at the fp32 floor)."""


def floor_level(ev: Any) -> float:
    """The run's precision floor: the last record's, else its context's dtypes', else fp32's; where the trainer
    measured the model's own noise at the engine's precision (`floor/measured`, `rlcheck.core.floors`), the
    median of its samples when that is higher (a run's level, not one step's)."""
    _, measured = metric_series(ev, K.FLOOR_MEASURED)
    return max(precision_level(ev), float(np.median(measured)) if measured.size else 0.0)


def precision_level(ev: Any) -> float:
    """The floor of the run's precision pair alone: the last record's `floor/level`, else its context's
    dtypes', else fp32's."""
    _, levels = metric_series(ev, K.FLOOR_LEVEL)
    if levels.size:
        return float(levels[-1])
    context = ev.meta().get("context") or {}
    level = Precision.from_context(context).level if isinstance(context, dict) else None
    return level if level is not None else LEVELS["float32"]


def clean_level(ev: Any) -> float:
    """Mean |d| under which a row (or the run's first step) is clean for the rules, at the run's floor."""
    return max(CLEAN, CLEAN_RATIO * floor_level(ev))


def precision_clean_level(ev: Any) -> float:
    """`clean_level` at the precision pair's floor alone, without the trainer's measure: for a rule whose off
    rows must also stand `CONTRAST` x over rows of the same step, which carry the model's measured noise."""
    return max(CLEAN, CLEAN_RATIO * precision_level(ev))


EXCESS = next(rule.limit for rule in DEFAULT_RULES if rule.metric == K.FLOOR_EXCESS)
"""The threshold detector's gate on the engine's clipped mean over the trainer's measured floor (`floor/excess`,
a dense model's): a step past it stands out of the model's own noise."""
ELEVATED = 5.0
"""A step is past its precision's noise at this many times the floor's level: the clipped-mean gate of the
threshold detector at the run's floor (0.05 on a bf16 engine, 5e-5 on fp32/fp32)."""


def elevated_steps(ev: Any) -> list[int]:
    """The steps that stand past one of the threshold detector's scaled gates at the run's floor (the clipped
    mean |d| past 5x the floor's level, the mean |p_train - p_rollout| past verl's 0.01 at bf16): one alarm
    marks the crossing, the gate then re-arms, and these are the steps that stayed past it. (A bf16 engine with
    16x bf16 noise crossed the probability gate at step 0 and stayed past it while its clipped mean, 0.02-0.05,
    stood under 0.05: counted on the clipped mean alone, one step, no `numeric_noise`.)"""
    level = precision_level(ev)  # the calibrated one for a run that calibrated
    steps, measured = metric_series(ev, K.FLOOR_MEASURED)  # a step with a sample: judged at it where higher
    at = {int(s): max(level, float(v)) for s, v in zip(steps, measured, strict=True)}
    out: set[int] = set()
    for rule in DEFAULT_RULES:
        if rule.scaled:
            steps, values = metric_series(ev, rule.metric)
            out.update(int(s) for s, v in zip(steps, values, strict=True)
                       if v > rule.limit * scale_of(at.get(int(s), level)))
    return sorted(out)


def resolution(ev: Any) -> str | None:
    """What a healthy verdict cannot see on a run judged above the fp32 floor: a fault whose mismatch stays within
    the precision's own noise (None on a fp32/fp32 run). On the demo's trained hybrid with a bf16 engine a
    trainer that left-pads the one prompt a token short is such a fault: its shift on the padded rows (fp32: a
    median 1e-3 nats a step, at most 0.023) is under the bf16 engine's own noise on the same rows (a median
    7.7e-3; BENCHMARKS.md, "Left padding under a bf16 engine's noise")."""
    level = floor_level(ev)
    if level <= LEVELS["float32"]:
        return None
    name = min(LEVELS, key=lambda k: abs(math.log(LEVELS[k] / level)))
    return (f"judged at the {name} floor ({level:g}; the clipped mean |d| gate {ELEVATED * level:g}): a fault whose "
            f"mismatch stays within {name}'s own noise is not seen; the engine in float32 (vLLM dtype='float32') sees to "
            f"{LEVELS['float32']:g}")
