"""Statistics the Monitor takes from a whole batch in one process (`Monitor.observe`; not reduced
across ranks, so `observe_partial` logs them only for the probe): the spread of the sequences'
mismatch levels, and the level of the sync check's fixed probe batch.

Each token's |d| is predicted from its engine probability p: healthy bf16 noise scales as
w = (1 - p)^c, c = `SURPRISE_POWER` (`benchmarks/data/field_fit.json`: log|d| ~ N(mu0 + 0.94 log(1 - p),
1.45) on the real loops), so a sequence's log residual level

    l_i = mean over its tokens with d != 0 of log(min(|d|, clip) / w)

does not depend on how peaked its tokens are, nor on the step's common level (which moves every l_i
alike). `seq/level_spread` = p90 - p50 of the l_i: a fault that raises a part of the batch (one
replica, one cache region) lifts the upper decile of the sequences away from their median, while
the step-to-step wobble of the floor and a trend leave it alone; the periodic detector watches it.
"""

from __future__ import annotations

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import response_mask

SURPRISE_POWER = 0.91
"""c of w = (1 - p)^c: the fit of `benchmarks/field_fit.py` (0.91 trained Llama, 0.97 trained hybrid)."""
MIN_TOKENS = 32
"""Tokens with d != 0 a sequence needs for its level to count (a shorter one's level is noise)."""
MIN_SEQUENCES = 8
"""Counted sequences a step needs for a spread."""
MIN_PROBE_TOKENS = 1024
"""Valid tokens a probe batch needs to serve as the drift detectors' control: its mean |d| must move
less than their 1.1x slack between steps (bf16 noise on 4,096 tokens: ~5%); the sync check's default
probe (2 prompts x 16 tokens) is a weights check, too small for it (see `rlcheck.loop.sync_check`)."""
MIN_WEIGHT = 1e-3
"""Tokens predicted below this (p > 0.9995) carry no level: bf16 rounds both sides alike."""


def level_spread(batch: StepBatch, clip: float, keep: np.ndarray | None = None) -> dict[str, float]:
    """{SEQ_LEVEL_SPREAD: p90 - p50 of the log residual levels of the sequences `keep` (N,) keeps},
    or {} with fewer than MIN_SEQUENCES sequences of MIN_TOKENS informative tokens."""
    lr = batch.logp_rollout.astype(np.float64)  # (M,)
    with np.errstate(invalid="ignore", divide="ignore"):
        ad = np.abs(batch.logp_train.astype(np.float64) - lr)
        w = (-np.expm1(np.minimum(lr, 0.0))) ** SURPRISE_POWER  # (M,)
        use = response_mask(batch, keep) & (ad > 0) & (w >= MIN_WEIGHT)
        logres = np.where(use, np.log(np.minimum(ad, clip)) - np.log(np.maximum(w, MIN_WEIGHT)), 0.0)
    cu = batch.cu_seqlens
    lens = np.diff(cu)
    nonempty = lens > 0
    count = np.zeros(lens.shape[0])
    total = np.zeros(lens.shape[0])
    count[nonempty] = np.add.reduceat(use, cu[:-1][nonempty], dtype=np.float64)
    total[nonempty] = np.add.reduceat(logres, cu[:-1][nonempty], dtype=np.float64)
    levels = total[count >= MIN_TOKENS] / count[count >= MIN_TOKENS]  # (S,)
    if levels.shape[0] < MIN_SEQUENCES:
        return {}
    p50, p90 = np.quantile(levels, [0.5, 0.9])
    return {K.SEQ_LEVEL_SPREAD: float(p90 - p50)}


def probe_level(probe: StepBatch | None, clip: float) -> dict[str, float]:
    """{PROBE_LEVEL: mean min(|d|, clip) over the probe batch's valid tokens}, or {} without one or
    with fewer than MIN_PROBE_TOKENS tokens.

    The probe's tokens are fixed (the sync check's teacher-forced batch), so its mismatch does not
    depend on what the policy samples: growth there is the engine's. The drift detector's control
    (`DetectorsConfig.control_drift`, `control_trend`) watch it."""
    valid = None if probe is None else response_mask(probe)
    if valid is None or np.count_nonzero(valid) < MIN_PROBE_TOKENS:
        return {}
    ad = np.abs(probe.logp_train[valid].astype(np.float64) - probe.logp_rollout[valid])
    return {K.PROBE_LEVEL: float(np.minimum(ad, clip).mean())}
