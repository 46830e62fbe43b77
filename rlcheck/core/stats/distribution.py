"""Beyond the sampled token: top-K overlap and a bucketed KL between the engine's and the trainer's
next-token distributions (`StatsConfig.distribution`, read from `StepBatch.topk`).

At each scored position, E is the engine's top-K set and R the trainer's; p_e = exp(logp_rollout)
and p_t = exp(logp_train) on E. The buckets are the tokens of E and one tail holding everything
else:

    tail_e = max(1 - sum_{v in E} p_e(v), 0)      tail_t = max(1 - sum_{v in E} p_t(v), 0)
    kl     = sum_{v in E} p_e(v) (log p_e(v) - log max(p_t(v), e^MIN_LOGPROB))
             + tail_e (log max(tail_e, res) - log max(tail_t, res))            (0 log 0 = 0)
    overlap = |E+ ∩ R| / |E+|      top1 = [argmax_E p_e == the trainer's argmax (ids_train[:, 0])]

E+ is E without the tokens the engine gives probability 0 (logprob -inf: outside a top-p nucleus, which
vLLM still lists among its top K), so the overlap asks whether the trainer ranks the engine's
possible tokens among its own top K; it is |E ∩ R| / K whenever the engine's K tokens are possible.

The trainer's top-K tokens outside E fall in the tail, since the engine did not score them: this is
the partition of the union E ∪ R coarsened to what both sides scored, so kl is a lower bound on the
full KL(engine || trainer). res = K * float32 eps is the resolution of a tail computed from K float32
logprobs: below it a tail is rounding (a peaked bf16 row sums to a hair over 1), not mass. Padding
entries (id -1) are ignored; a position counts when the batch mask keeps it and E has an entry.
"""

from __future__ import annotations

import math

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.topk import PAD_ID, TopK

_SUMS = ("dist_n", "dist_kl", "dist_overlap", "dist_top1", "dist_tail_e", "dist_tail_t")
_MAXIMA = ("dist_kl",)
_CHUNK = 1 << 20  # (rows, K) entries per pass: rows are chunked so the float64 temporaries stay small


def distribution_stats(topk: TopK | None, mask: np.ndarray | None, sums: dict, maxima: dict) -> None:
    """Add the distribution sums and maxima of `topk`'s rows kept by `mask` (M,) to `sums` and
    `maxima`; zeros (and -inf) without `topk`, so every partial of a run has the same keys."""
    sums.update(dict.fromkeys(_SUMS, 0.0))
    maxima.update(dict.fromkeys(_MAXIMA, -math.inf))
    if topk is None or topk.num_tokens == 0:
        return
    rows = np.flatnonzero((topk.ids_rollout != PAD_ID).any(axis=1) & (True if mask is None else mask))  # (n,)
    step = max(1, _CHUNK // topk.k)
    for lo in range(0, rows.shape[0], step):
        rs = rows[lo:lo + step]
        kl, overlap, top1, tail_e, tail_t = position_stats(
            topk.ids_rollout[rs], topk.logp_rollout[rs], topk.logp_train[rs], topk.ids_train[rs])  # (C,) each
        sums["dist_n"] += float(kl.shape[0])
        sums["dist_kl"] += float(kl.sum())
        sums["dist_overlap"] += float(overlap.sum())
        sums["dist_top1"] += float(np.count_nonzero(top1))
        sums["dist_tail_e"] += float(tail_e.sum())
        sums["dist_tail_t"] += float(tail_t.sum())
        maxima["dist_kl"] = max(maxima["dist_kl"], float(kl.max()))


def position_stats(ie: np.ndarray, le: np.ndarray, lt: np.ndarray, it: np.ndarray) -> tuple[np.ndarray, ...]:
    """(kl, overlap, top1, tail_e, tail_t), each (M,), of the rows of a TopK's (M, K) fields (ids_rollout,
    logp_rollout, logp_train, ids_train; float64 out, top1 bool); the definitions are the module docstring's."""
    k = ie.shape[1]
    le, lt = le.astype(np.float64), lt.astype(np.float64)  # (M, K)
    ve = ie != PAD_ID  # (M, K) entries of E
    res = k * float(np.finfo(np.float32).eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        pe = np.where(ve, np.exp(le), 0.0)  # (M, K)
        pt = np.where(ve, np.exp(lt), 0.0)
        tail_e = np.maximum(1.0 - pe.sum(axis=1), 0.0)  # (M,)
        tail_t = np.maximum(1.0 - pt.sum(axis=1), 0.0)
        terms = np.where(pe > 0, pe * (le - np.maximum(lt, MIN_LOGPROB)), 0.0)  # (M, K)
        tail = np.where(tail_e > 0, tail_e * (np.log(np.maximum(tail_e, res)) - np.log(np.maximum(tail_t, res))), 0.0)
    kl = terms.sum(axis=1) + tail  # (M,)
    possible = ve & np.isfinite(le)  # (M, K) E+
    both = np.sort(np.concatenate([np.where(possible, ie, PAD_ID), it], axis=1), axis=1)  # (M, 2K): ids distinct per side
    shared = ((both[:, 1:] == both[:, :-1]) & (both[:, 1:] != PAD_ID)).sum(axis=1)  # (M,) |E+ ∩ R|
    overlap = shared / np.maximum(possible.sum(axis=1), 1)
    top_e = ie[np.arange(ie.shape[0]), np.argmax(np.where(ve, le, -np.inf), axis=1)]  # (M,) engine's argmax
    top1 = (top_e == it[:, 0]) & (top_e != PAD_ID)
    return kl, overlap, top1, tail_e, tail_t


def distribution_metrics(sums: dict, maxima: dict) -> dict[str, float]:
    """The `rlcheck/dist/*` metrics of merged sums; {} when no position was scored (or the sums do not
    hold them: `StatsConfig.distribution` off)."""
    n = sums.get("dist_n", 0.0)
    if n <= 0:
        return {}
    return {
        K.DIST_COUNT: n,
        K.DIST_KL_MEAN: max(sums["dist_kl"] / n, 0.0),  # the bucket sums are normalised up to rounding
        K.DIST_KL_MAX: max(maxima["dist_kl"], 0.0),
        K.DIST_TOPK_OVERLAP_MEAN: sums["dist_overlap"] / n,
        K.DIST_TOP1_AGREE_FRAC: sums["dist_top1"] / n,
        K.DIST_TAIL_MASS_ROLLOUT_MEAN: sums["dist_tail_e"] / n,
        K.DIST_TAIL_MASS_TRAIN_MEAN: sums["dist_tail_t"] / n,
    }
