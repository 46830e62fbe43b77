"""compute_partial: one batch's token sums, extrema and |d| histogram (then sequences, signatures).

Passes over the M tokens are few and reuse one scratch buffer; float32 sums are accumulated through
float32 block sums added in float64, so nothing is lost to a large outlier among millions of terms.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from rlcheck.core import histogram as H
from rlcheck.core.batch import StepBatch
from rlcheck.core.stats.backend import choose
from rlcheck.core.stats.distribution import distribution_stats
from rlcheck.core.stats.residual import add_residual
from rlcheck.core.stats.sequences import sequence_stats
from rlcheck.core.stats.signatures import signature_stats
from rlcheck.core.stats.sums import sum64, sum_product
from rlcheck.core.stats.turns import turn_partial, turn_positions
from rlcheck.core.stats.twins import add_twins
from rlcheck.core.stats.types import (
    F32_SAFE,
    MAX_VERSION_IDS,
    MIN_LOGPROB,
    R_FROM_E,
    RATIO_LOG_CAP,
    PartialStats,
    StatsConfig,
)

_R_FLOOR = -300.0  # d below this counts as this in sum r, sum r^2: r^2 stays a normal float64 (> 0)

def _validity(batch: StepBatch, lr: np.ndarray, lt: np.ndarray, sum_d: float) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(valid, nonfinite) token masks, or None where every token qualifies / none is non-finite."""
    mask = batch.mask
    if mask is not None and mask.all():
        mask = None  # from_padded attaches a mask even when nothing is masked
    with np.errstate(invalid="ignore"):
        lowest = min(lr.min(), lt.min())  # NaN when a NaN is present
    nonfinite = None
    if not lowest >= MIN_LOGPROB or not math.isfinite(sum_d):  # NaN, -inf or a -1e9-style sentinel
        nonfinite = ~((lr >= MIN_LOGPROB) & (lt >= MIN_LOGPROB))
        if mask is not None:
            nonfinite &= mask  # a masked-out token was never meant to be compared
        if not nonfinite.any():
            nonfinite = None
    if nonfinite is None:
        return mask, None
    return (~nonfinite if mask is None else mask & ~nonfinite), nonfinite


def _ratio_sums(d, d_min, n, valid, sums, scratch) -> tuple[float, float]:
    """(sum r, sum r^2) over the valid tokens, for the ESS. From the sums of e = r - 1 while every d is
    above R_FROM_E; else from exp(d) itself, since 1 + e cancels (d = -40: 1 + (-1 + 4e-18) = 0, and
    an ESS of 0 / 0)."""
    if d_min >= R_FROM_E:
        return sums["e"] + n, sums["e2"] + 2.0 * sums["e"] + n
    r = np.exp(np.clip(d, _R_FLOOR, RATIO_LOG_CAP, out=scratch), out=scratch)  # (M,)
    if valid is not None:
        r[~valid] = 0.0  # invalid tokens hold d = 0 (r = 1) but do not count
    sum_r = sum64(r)
    return sum_r, sum64(np.multiply(r, r, out=r))


def empty_partial(cfg: StatsConfig | None = None, num_sequences: int = 0) -> PartialStats:
    """The statistics of `num_sequences` sequences without a token, in `cfg`'s layout: merging it
    changes nothing but the sequence counts (sums 0, extrema -inf / +inf, empty histograms, no
    offender). A rank with nothing to compare this step passes it (`num_sequences=0`) to
    `rlcheck.distributed.all_reduce_partial`, so the collective the other ranks wait in completes."""
    one = compute_partial(StepBatch.from_ragged(logp_rollout=[np.zeros(1)], logp_train=[np.zeros(1)],
                                                request_ids=["-"]), cfg)
    sums = dict.fromkeys(one.sums, 0.0)
    sums["seq_total"] = sums["seq_empty"] = float(num_sequences)
    return replace(
        one,
        sums=sums,
        maxima=dict.fromkeys(one.maxima, -math.inf),
        minima=dict.fromkeys(one.minima, math.inf),
        hists={key: np.zeros_like(h) for key, h in one.hists.items()},
        offenders=(),
        num_sequences=num_sequences,
    )


def compute_partial(batch: StepBatch, cfg: StatsConfig | None = None) -> PartialStats:
    """Sums, extrema, histograms and top-K offenders of `batch` (a batch without a single token:
    those of its empty sequences)."""
    cfg = cfg or StatsConfig()
    if batch.num_tokens == 0:
        return replace(empty_partial(cfg, batch.num_sequences), versions=version_counts(batch))
    backend = choose(batch, cfg.backend)
    if backend != "numpy":
        from rlcheck.core.stats.torch_partial import compute_partial_torch

        return compute_partial_torch(batch, cfg, backend == "torch", version_counts(batch))
    lr, lt = batch.logp_rollout, batch.logp_train  # (M,)
    if lr.dtype != lt.dtype:
        lr, lt = lr.astype(np.float64), lt.astype(np.float64)
    d = lt - lr  # (M,)
    m_total = d.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        sum_d = float(np.add.reduce(d, dtype=np.float64))  # signed: cancels, so float64 all the way
    valid, nonfinite = _validity(batch, lr, lt, sum_d)
    if valid is not None:  # invalid tokens become exact matches at 0 and are subtracted from counts
        lr, lt = np.where(valid, lr, 0), np.where(valid, lt, 0)
        d = lt - lr
        sum_d = float(np.add.reduce(d, dtype=np.float64))
        n = int(np.count_nonzero(valid))
        d_max = float(np.max(d, where=valid, initial=-np.inf))
        d_min = float(np.min(d, where=valid, initial=np.inf))
    else:
        n = m_total
        d_max, d_min = float(d.max()), float(d.min())
    ad = np.abs(d)  # (M,)
    ad_max = max(d_max, -d_min, 0.0)
    if ad_max > F32_SAFE and d.dtype != np.float64:
        d, ad, lr, lt = (x.astype(np.float64) for x in (d, ad, lr, lt))
    scratch = np.empty_like(d)

    clipped = int(np.count_nonzero(d > RATIO_LOG_CAP)) if d_max > RATIO_LOG_CAP else 0
    e = np.expm1(np.minimum(d, RATIO_LOG_CAP) if clipped else d)  # r - 1, (M,)
    sums = {
        "n": float(n),
        "n_masked": float(0 if batch.mask is None else m_total - np.count_nonzero(batch.mask)),
        "n_nonfinite": float(0 if nonfinite is None else np.count_nonzero(nonfinite)),
        "d": sum_d,
        "ad": sum64(ad),
        "d2": sum_product(d, d, scratch),
        "e": sum64(e),
        "e2": sum_product(e, e, scratch),
        "k3": sum64(np.subtract(e, d, out=scratch)),  # r - 1 - d, summed per token: nothing cancels
        "mpe": sum64(np.expm1(np.minimum(ad, RATIO_LOG_CAP) if ad_max > RATIO_LOG_CAP else ad, out=scratch)),
        "ratio_above": float(np.count_nonzero(e > cfg.ratio_c - 1.0)),
        "clipped": float(clipped),
    }
    sums["r"], sums["r2"] = _ratio_sums(d, d_min, n, valid, sums, scratch)
    # |exp(lt) - exp(lr)| = exp(lr) * |r - 1|, or exp(max) * (1 - exp(-|d|)) where r was capped
    pdiff = np.abs(e, out=scratch)
    pdiff *= np.exp(lr)
    if clipped:
        pdiff = np.exp(np.maximum(lt, lr)) * -np.expm1(-ad)
    sums["pdiff"] = sum64(pdiff)
    for i, t in enumerate(cfg.thresholds):
        sums[f"thr{i}"] = float(np.count_nonzero(ad > t))
    maxima = {"ad": ad_max, "d": d_max, "pdiff": float(pdiff.max()) if m_total else 0.0}
    turn = None if batch.turns is None else turn_partial(batch, cfg, d, ad, e, pdiff, valid, sums, maxima)
    sums["cat_tok"] = float(np.count_nonzero(ad >= cfg.catastrophic_tau if turn is None else turn.cat))
    # pdiff (in scratch) is done with; a multi-turn batch's turn pass computed min(|d|, clip) already
    sums["ad_clip"] = sum64(np.minimum(ad, cfg.clip, out=scratch) if turn is None else turn.ad_clip)
    hist = H.abs_histogram(ad)
    hist[0] -= m_total - n
    hists = {"ad": hist}
    minima = {"d": d_min}

    offenders = sequence_stats(batch, cfg, d, ad, valid, nonfinite, sums, maxima, minima, hists)
    offenders = offenders if turn is None else turn_positions(offenders, batch, turn.seg)
    signature_stats(batch, cfg, lr, lt, d, valid, sums, scratch)
    add_twins(batch, cfg, sums, maxima, minima)
    add_residual(batch, cfg, sums)
    if cfg.distribution:
        distribution_stats(batch.topk, batch.mask, sums, maxima)
    return PartialStats(sums, maxima, minima, hists, offenders, batch.num_sequences, tuple(cfg.thresholds), cfg.top_k,
                        versions=version_counts(batch))


def version_counts(batch: StepBatch) -> dict[int, tuple[int, tuple[str, ...]]]:
    """The batch's sequences per weight version, with their first request ids ({} without versions)."""
    if batch.weight_version is None:
        return {}
    versions, which = np.unique(batch.weight_version, return_inverse=True)  # (V,), (N,)
    out = {}
    for i, version in enumerate(versions.tolist()):
        seqs = np.flatnonzero(which == i)
        out[int(version)] = (int(seqs.size), tuple(batch.request_ids[j] for j in seqs[:MAX_VERSION_IDS].tolist()))
    return out
