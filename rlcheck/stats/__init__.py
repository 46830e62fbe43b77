"""Per-step mismatch statistics over packed tokens, in two stages so that ranks can merge:

    partial = compute_partial(batch, cfg)      # sums, counts, extrema, histograms, top-K offenders
    partial = merge([p_rank0, p_rank1, ...])   # exact: sums add, extrema combine, histograms add
    metrics, offenders = finalize(partial, cfg)

`compute(batch, cfg)` does all three for one process. Everything is vectorised over tokens (segment
reductions with `np.*.reduceat`, no Python loop over sequences). With d = logp_train - logp_rollout,
r = exp(d) and n valid tokens, the token metrics are

    kl_k1 = mean(-d)   kl_k2 = mean(d^2 / 2)   kl_k3 = mean(r - 1 - d)   chi2 = mean(r^2) - 1
    mult_prob_error = mean(exp|d|)             prob_abs_diff = |exp(logp_train) - exp(logp_rollout)|

computed as expm1(d) so that nothing cancels for tiny d; d is capped at RATIO_LOG_CAP before any
exponential (so nothing overflows) and the capped tokens are counted in `ratio/clipped_count`.
Non-finite tokens (NaN, -inf, or a sentinel below MIN_LOGPROB such as -1e9, on either side, and not
masked out) are left out of every statistic, counted in `token/nonfinite_count`, and mark their
sequence as flagged and catastrophic.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from rlcheck.batch import StepBatch
from rlcheck.stats.finalize import finalize
from rlcheck.stats.partial import compute_partial
from rlcheck.stats.types import MIN_LOGPROB, RATIO_LOG_CAP, Offender, PartialStats, StatsConfig, merge


def compute(batch: StepBatch, cfg: StatsConfig | None = None) -> tuple[dict[str, float], tuple[Offender, ...]]:
    """Metrics and offenders of one batch in this process."""
    cfg = cfg or StatsConfig()
    return finalize(compute_partial(batch, cfg), cfg)


def empty_partial(cfg: StatsConfig | None = None) -> PartialStats:
    """The statistics of no sequence, in `cfg`'s layout: merging it changes nothing (sums 0, extrema
    -inf / +inf, empty histograms, no offender). A rank with nothing to compare this step passes it to
    `rlcheck.distributed.all_reduce_partial`, so the collective the other ranks wait in completes."""
    one = compute_partial(StepBatch.from_ragged(logp_rollout=[np.zeros(1)], logp_train=[np.zeros(1)],
                                                request_ids=["-"]), cfg)
    return replace(
        one,
        sums=dict.fromkeys(one.sums, 0.0),
        maxima=dict.fromkeys(one.maxima, -math.inf),
        minima=dict.fromkeys(one.minima, math.inf),
        hists={key: np.zeros_like(h) for key, h in one.hists.items()},
        offenders=(),
        num_sequences=0,
    )


__all__ = [
    "MIN_LOGPROB", "RATIO_LOG_CAP", "Offender", "PartialStats", "StatsConfig", "compute", "compute_partial",
    "empty_partial", "finalize", "merge",
]
