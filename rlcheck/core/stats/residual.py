"""The step's residual level: its mean |d| with the token mix taken out. Each token's clipped |d| over
what healthy noise predicts from its engine probability, w = (1 - p)^0.91 (`levels`), averaged over
the informative tokens (d != 0, w >= MIN_WEIGHT):

    residual_level = mean(min(|d|, clip) / w)

Responses that grow longer and less peaked raise the mean |d| (more uncertain tokens) but not this:
a healthy long chain-of-thought run's mean |d| grows ~5x over 1,200 steps, its residual level ~2x
(the floor's own growth), while an engine drifting 5x over 450 steps moves both alike. The residual
trend detector (`DetectorsConfig.residual_trend`) watches it: the drift a run without a probe can
see. Mergeable sums, from the batch's host arrays in either backend.
"""

from __future__ import annotations

import numpy as np

from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.stats.levels import MIN_WEIGHT, SURPRISE_POWER


def add_residual(batch, cfg, sums: dict) -> None:
    """Add `res_sum` and `res_n` (the informative tokens' clipped residuals and their count) to `sums`."""
    lr, lt = batch.logp_rollout.astype(np.float64), batch.logp_train.astype(np.float64)  # (M,)
    with np.errstate(invalid="ignore"):
        ad = np.abs(lt - lr)
        w = (-np.expm1(np.minimum(lr, 0.0))) ** SURPRISE_POWER
        use = (lr >= MIN_LOGPROB) & (lt >= MIN_LOGPROB) & (ad > 0) & (w >= MIN_WEIGHT)  # NaN, -inf, sentinels out
    if batch.mask is not None:
        use &= batch.mask
    sums["res_sum"] = float(np.sum(np.minimum(ad[use], cfg.clip) / w[use], dtype=np.float64))
    sums["res_n"] = float(np.count_nonzero(use))
