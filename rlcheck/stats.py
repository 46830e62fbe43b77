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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rlcheck import histogram as H
from rlcheck import metrics as K
from rlcheck.batch import StepBatch

RATIO_LOG_CAP = 50.0  # d above this is capped before exp: r <= e^50 ~ 5e21
MIN_LOGPROB = -1e4  # below this a "logprob" is a stand-in for -inf (-1e9, finfo.min): counted as non-finite
_F32_SAFE = 20.0  # below this |d|, float32 exponentials and their squared sums cannot overflow


@dataclass(frozen=True)
class StatsConfig:
    """What the statistics count as divergent; defaults are written once, here."""

    thresholds: tuple[float, ...] = (0.1, 0.5, 1.0)
    """|d| levels whose token fraction is reported (`token/frac_abs_diff_gt_<t>`)."""
    divergence_tau: float = 0.5
    """|d| above which a token diverges: first-divergence position and flagged sequences."""
    catastrophic_tau: float = 2.0
    """A sequence with max |d| at or above this (probability off by e^2 ~ 7x) is catastrophic."""
    early_window: int = 4
    """A catastrophic sequence whose first divergence is before this position diverged early."""
    ratio_c: float = 2.0
    """`ratio/frac_above_c` counts tokens with r > ratio_c."""
    top_k: int = 10
    """Offenders kept per step (sequences with the largest max |d|)."""
    shift_window: int = 32
    """Leading tokens of each sequence used by the shift-by-one statistic."""

    def __post_init__(self) -> None:
        if any(not (t > 0 and math.isfinite(t)) for t in self.thresholds):
            raise ValueError(f"thresholds must be positive and finite, got {self.thresholds}")
        for name in ("divergence_tau", "catastrophic_tau"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.ratio_c > 1:
            raise ValueError(f"ratio_c must be > 1, got {self.ratio_c}")
        if self.catastrophic_tau < self.divergence_tau:
            raise ValueError("catastrophic_tau must be >= divergence_tau (a catastrophic sequence has diverged)")
        keys = [f"{t:g}" for t in self.thresholds]
        if len(set(keys)) != len(keys):
            raise ValueError(f"thresholds must differ in their first 6 significant digits, got {self.thresholds}")
        for name in ("early_window", "top_k", "shift_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Offender:
    """A sequence among the step's worst by max |d|."""

    request_id: str
    index: int  # position of the sequence in the observed batch
    max_abs_diff: float  # over its finite tokens
    first_divergence: int | None  # first token with |d| > divergence_tau (or non-finite); None if none
    length: int
    mean_diff: float  # mean d over its valid tokens
    nonfinite: bool = False

    @property
    def score(self) -> float:
        return math.inf if self.nonfinite else self.max_abs_diff

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "index": self.index,
            "max_abs_diff": self.max_abs_diff,
            "first_divergence": self.first_divergence,
            "length": self.length,
            "mean_diff": self.mean_diff,
            "nonfinite": self.nonfinite,
        }


def _rank(offenders: Sequence[Offender], k: int) -> tuple[Offender, ...]:
    return tuple(sorted(offenders, key=lambda o: (-o.score, o.index))[:k])


@dataclass
class PartialStats:
    """Mergeable statistics of some sequences. Keys are internal; `finalize` names the metrics."""

    sums: dict[str, float]
    maxima: dict[str, float]
    minima: dict[str, float]
    hists: dict[str, np.ndarray]
    offenders: tuple[Offender, ...]
    num_sequences: int
    thresholds: tuple[float, ...] = field(default=())
    top_k: int = 10


def merge(parts: Sequence[PartialStats], top_k: int | None = None) -> PartialStats:
    """Combine partial statistics of disjoint sequence sets, given in batch order (rank 0 first):
    offender indices are shifted so they count from the start of the combined batch."""
    if not parts:
        raise ValueError("merge needs at least one PartialStats")
    first = parts[0]
    offenders: list[Offender] = []
    offset = 0
    for p in parts:
        offenders += [replace(o, index=o.index + offset) for o in p.offenders]
        offset += p.num_sequences
    k = top_k if top_k is not None else first.top_k
    return PartialStats(
        sums={key: sum(p.sums[key] for p in parts) for key in first.sums},
        maxima={key: max(p.maxima[key] for p in parts) for key in first.maxima},
        minima={key: min(p.minima[key] for p in parts) for key in first.minima},
        hists={key: np.sum([p.hists[key] for p in parts], axis=0) for key in first.hists},
        offenders=_rank(offenders, k),
        num_sequences=offset,
        thresholds=first.thresholds,
        top_k=k,
    )


def compute(batch: StepBatch, cfg: StatsConfig | None = None) -> tuple[dict[str, float], tuple[Offender, ...]]:
    """Metrics and offenders of one batch in this process."""
    cfg = cfg or StatsConfig()
    return finalize(compute_partial(batch, cfg), cfg)


def _f64sum(x: np.ndarray) -> float:
    return float(np.add.reduce(x, dtype=np.float64))


def compute_partial(batch: StepBatch, cfg: StatsConfig | None = None) -> PartialStats:
    """Sums, extrema, histograms and top-K offenders of `batch`."""
    cfg = cfg or StatsConfig()
    lr, lt = batch.logp_rollout, batch.logp_train  # (M,)
    if lr.dtype != lt.dtype:
        lr, lt = lr.astype(np.float64), lt.astype(np.float64)
    d = lt - lr  # (M,)
    m_total = d.shape[0]
    with np.errstate(invalid="ignore"):
        lowest = min(lr.min(), lt.min())  # NaN when a NaN is present
        sum_d = _f64sum(d)
    nonfinite = None
    if not lowest >= MIN_LOGPROB or not math.isfinite(sum_d):  # NaN, -inf or a -1e9-style sentinel
        nonfinite = ~((lr >= MIN_LOGPROB) & (lt >= MIN_LOGPROB))
        if batch.mask is not None:
            nonfinite &= batch.mask  # a masked-out token was never meant to be compared
        if not nonfinite.any():
            nonfinite = None
    valid = batch.mask
    if nonfinite is not None:
        valid = ~nonfinite if valid is None else valid & ~nonfinite
    if valid is not None:  # invalid tokens become exact matches at 0 and are subtracted from counts
        lr, lt = np.where(valid, lr, 0), np.where(valid, lt, 0)
        d = lt - lr
        sum_d = _f64sum(d)
        n = int(np.count_nonzero(valid))
        d_max = float(np.max(d, where=valid, initial=-np.inf))
        d_min = float(np.min(d, where=valid, initial=np.inf))
    else:
        n = m_total
        d_max, d_min = float(d.max()), float(d.min())
    n_zeroed = m_total - n
    ad = np.abs(d)  # (M,)
    ad_max = max(d_max, -d_min, 0.0)

    if ad_max > _F32_SAFE and d.dtype != np.float64:
        d, ad = d.astype(np.float64), ad.astype(np.float64)
    clipped = 0
    dc = d
    if d_max > RATIO_LOG_CAP:
        clipped = int(np.count_nonzero(d > RATIO_LOG_CAP))
        dc = np.minimum(d, RATIO_LOG_CAP)
    e = np.expm1(dc)  # r - 1, (M,)
    mpe = np.expm1(np.minimum(ad, RATIO_LOG_CAP) if ad_max > RATIO_LOG_CAP else ad)  # exp|d| - 1
    # |exp(lt) - exp(lr)| = exp(max(lt, lr)) * (1 - exp(-|d|)): no cancellation, no overflow
    pdiff = np.exp(np.maximum(lt, lr))
    pdiff *= -np.expm1(-ad)

    hist = H.abs_histogram(ad)
    hist[0] -= n_zeroed
    sums = {
        "n": float(n),
        "n_masked": float(0 if batch.mask is None else m_total - np.count_nonzero(batch.mask)),
        "n_nonfinite": float(0 if nonfinite is None else np.count_nonzero(nonfinite)),
        "d": sum_d,
        "ad": _f64sum(ad),
        "d2": float(np.dot(d, d)),
        "e": _f64sum(e),
        "e2": float(np.dot(e, e)),
        "mpe": _f64sum(mpe),
        "pdiff": _f64sum(pdiff),
        "ratio_above": float(np.count_nonzero(e > cfg.ratio_c - 1.0)),
        "clipped": float(clipped),
    }
    for i, t in enumerate(cfg.thresholds):
        sums[f"thr{i}"] = float(np.count_nonzero(ad > t))
    maxima = {"ad": ad_max, "d": d_max, "pdiff": float(pdiff.max()) if m_total else 0.0}
    minima = {"d": d_min}
    hists = {"ad": hist}

    offenders = _sequence_stats(batch, cfg, d, ad, valid, nonfinite, sums, maxima, minima, hists)
    _signature_stats(batch, cfg, lr, lt, d, valid, sums)
    return PartialStats(sums, maxima, minima, hists, offenders, batch.num_sequences, tuple(cfg.thresholds), cfg.top_k)


def _sequence_stats(batch, cfg, d, ad, valid, nonfinite, sums, maxima, minima, hists) -> tuple[Offender, ...]:
    """Per-sequence reductions (into the dicts) and the top-K offenders."""
    cu = batch.cu_seqlens  # (N+1,) int64
    lens = np.diff(cu)  # (N,)
    num = lens.shape[0]
    nonempty = lens > 0
    starts = cu[:-1][nonempty]
    seq_max = np.zeros(num, dtype=np.float64)
    seq_sum = np.zeros(num, dtype=np.float64)
    seq_max[nonempty] = np.maximum.reduceat(ad, starts)
    seq_sum[nonempty] = np.add.reduceat(d, starts, dtype=np.float64)
    if valid is None:
        counts = lens
    else:
        counts = np.zeros(num, dtype=np.int64)
        counts[nonempty] = np.add.reduceat(valid, starts, dtype=np.int64)
    seq_bad = np.zeros(num, dtype=bool)  # holds a non-finite token
    if nonfinite is not None:
        seq_bad[nonempty] = np.logical_or.reduceat(nonfinite, starts)
    counted = counts > 0
    seq_mean = seq_sum / np.maximum(counts, 1)

    diverged = ad > cfg.divergence_tau
    if nonfinite is not None:
        diverged |= nonfinite
    pos = np.flatnonzero(diverged)  # (F,) token indices, ascending
    seq_of = np.searchsorted(cu, pos, side="right") - 1
    div_seq, first_idx = np.unique(seq_of, return_index=True)
    div_pos = pos[first_idx] - cu[div_seq]  # (D,) first divergence position per diverged sequence
    first_div = np.full(num, -1, dtype=np.int64)  # internal only; Offender uses None
    first_div[div_seq] = div_pos

    catastrophic = (seq_max >= cfg.catastrophic_tau) | seq_bad
    early = catastrophic & (first_div >= 0) & (first_div < cfg.early_window)
    sums.update(
        seq_total=float(num),
        seq_n=float(np.count_nonzero(counted)),
        seq_empty=float(num - np.count_nonzero(counted)),
        seq_max=float(seq_max[counted].sum()),
        seq_logratio=float(seq_sum[counted].sum()),
        seq_lppl=float(seq_mean[counted].sum()),
        seq_flagged=float(np.count_nonzero((seq_max > cfg.divergence_tau) | seq_bad)),
        seq_cat=float(np.count_nonzero(catastrophic)),
        early_div=float(np.count_nonzero(early)),
    )
    maxima.update(
        seq_logratio=float(np.abs(seq_sum[counted]).max(initial=0.0)),
        seq_lppl=float(np.abs(seq_mean[counted]).max(initial=0.0)),
    )
    minima["first_div"] = float(div_pos.min()) if div_pos.size else math.inf
    hists["first_div"] = H.position_histogram(div_pos)

    score = np.where(seq_bad, np.inf, seq_max)
    k = min(cfg.top_k, num)
    top = np.argpartition(-score, k - 1)[:k] if k < num else np.arange(num)
    return _rank(
        [
            Offender(
                request_id=batch.request_ids[i],
                index=int(i),
                max_abs_diff=float(seq_max[i]),
                first_divergence=int(first_div[i]) if first_div[i] >= 0 else None,
                length=int(lens[i]),
                mean_diff=float(seq_mean[i]),
                nonfinite=bool(seq_bad[i]),
            )
            for i in top
        ],
        k,
    )


def _signature_stats(batch, cfg, lr, lt, d, valid, sums) -> None:
    """Sums behind the signature detectors: slope of d on logp_rollout, shift-by-one fit, token ids."""
    sums["lr"] = _f64sum(lr)
    sums["lr2"] = float(np.dot(lr.astype(np.float64), lr.astype(np.float64)))
    sums["dlr"] = float(np.dot(d.astype(np.float64), lr.astype(np.float64)))

    # Pairs (j, j+1) inside the first shift_window tokens of each sequence.
    cu = batch.cu_seqlens
    span = np.minimum(np.diff(cu), cfg.shift_window) - 1  # pairs per sequence
    span = np.maximum(span, 0)
    total = int(span.sum())
    if total:
        offs = np.zeros(span.shape[0], dtype=np.int64)
        np.cumsum(span[:-1], out=offs[1:])
        j = np.repeat(cu[:-1] - offs, span) + np.arange(total, dtype=np.int64)  # (P,)
        ok = np.ones(total, dtype=bool) if valid is None else valid[j] & valid[j + 1]
        sums["sh_n"] = float(np.count_nonzero(ok))
        sums["sh_e0"] = float(np.abs(lt[j] - lr[j])[ok].sum())
        sums["sh_ep"] = float(np.abs(lt[j] - lr[j + 1])[ok].sum())  # train[t] vs rollout[t+1]
        sums["sh_em"] = float(np.abs(lt[j + 1] - lr[j])[ok].sum())  # train[t+1] vs rollout[t]
    else:
        sums.update(sh_n=0.0, sh_e0=0.0, sh_ep=0.0, sh_em=0.0)

    if batch.tokens is not None and batch.tokens_train is not None:
        compared = batch.mask if batch.mask is not None else np.ones(batch.num_tokens, dtype=bool)
        sums["tok_n"] = float(np.count_nonzero(compared))
        sums["tok_mismatch"] = float(np.count_nonzero((batch.tokens != batch.tokens_train) & compared))
    else:
        sums["tok_n"] = 0.0
        sums["tok_mismatch"] = 0.0


def finalize(p: PartialStats, cfg: StatsConfig | None = None) -> tuple[dict[str, float], tuple[Offender, ...]]:
    """Metric dict (every value finite) and offenders from merged partial statistics."""
    cfg = cfg or StatsConfig()
    s, mx, mn = p.sums, p.maxima, p.minima
    n = s["n"]
    out: dict[str, float] = {
        K.TOKEN_COUNT: n,
        K.TOKEN_MASKED_COUNT: s["n_masked"],
        K.NONFINITE_COUNT: s["n_nonfinite"],
        K.RATIO_CLIPPED_COUNT: s["clipped"],
        K.SEQ_COUNT: s["seq_total"],
        K.SEQ_EMPTY_COUNT: s["seq_empty"],
        K.SEQ_FLAGGED_FRAC: s["seq_flagged"] / max(s["seq_total"], 1.0),
        K.SEQ_CATASTROPHIC_COUNT: s["seq_cat"],
        K.SEQ_CATASTROPHIC_FRAC: s["seq_cat"] / max(s["seq_total"], 1.0),
        K.SIG_EARLY_DIV_COUNT: s["early_div"],
    }
    if n > 0:
        out.update(_token_metrics(p, cfg))
    if s["seq_n"] > 0:
        ns = s["seq_n"]
        out.update({
            K.SEQ_MAX_ABS_DIFF_MEAN: s["seq_max"] / ns,
            K.SEQ_MAX_ABS_DIFF_MAX: mx["ad"],
            K.SEQ_LOG_RATIO_MEAN: s["seq_logratio"] / ns,
            K.SEQ_LOG_RATIO_ABS_MAX: mx["seq_logratio"],
            K.SEQ_LOG_PPL_DIFF_MEAN: s["seq_lppl"] / ns,
            K.SEQ_LOG_PPL_DIFF_ABS_MAX: mx["seq_lppl"],
        })
    if math.isfinite(mn["first_div"]):
        out[K.FIRST_DIV_MIN] = mn["first_div"]
        out[K.FIRST_DIV_P50] = float(H.position_quantile(p.hists["first_div"], 0.5))
    if s["tok_n"] > 0:
        out[K.SIG_TOKEN_MISMATCH_COUNT] = s["tok_mismatch"]
        out[K.SIG_TOKEN_MISMATCH_FRAC] = s["tok_mismatch"] / s["tok_n"]
    return out, p.offenders


def _token_metrics(p: PartialStats, cfg: StatsConfig) -> dict[str, float]:
    s, mx, mn = p.sums, p.maxima, p.minima
    n = s["n"]
    mean_e, mean_e2 = s["e"] / n, s["e2"] / n
    sum_r, sum_r2 = s["e"] + n, s["e2"] + 2.0 * s["e"] + n
    ad_max = mx["ad"]
    out = {
        K.ABS_DIFF_MEAN: s["ad"] / n,
        K.ABS_DIFF_P50: H.quantile(p.hists["ad"], H.ABS_EDGES, 0.50, ad_max),
        K.ABS_DIFF_P90: H.quantile(p.hists["ad"], H.ABS_EDGES, 0.90, ad_max),
        K.ABS_DIFF_P99: H.quantile(p.hists["ad"], H.ABS_EDGES, 0.99, ad_max),
        K.ABS_DIFF_MAX: ad_max,
        K.DIFF_MEAN: s["d"] / n,
        K.KL_K1: -s["d"] / n,
        K.KL_K2: s["d2"] / (2.0 * n),
        K.KL_K3: max((s["e"] - s["d"]) / n, 0.0),
        K.CHI2: mean_e2 + 2.0 * mean_e,
        K.PROB_ABS_DIFF_MEAN: s["pdiff"] / n,
        K.PROB_ABS_DIFF_MAX: mx["pdiff"],
        K.MULT_PROB_ERROR: 1.0 + s["mpe"] / n,
        K.RATIO_MEAN: 1.0 + mean_e,
        K.RATIO_STD: math.sqrt(max(mean_e2 - mean_e * mean_e, 0.0)),
        K.RATIO_MIN: math.exp(max(min(mn["d"], RATIO_LOG_CAP), -700.0)),
        K.RATIO_MAX: math.exp(min(mx["d"], RATIO_LOG_CAP)),
        K.RATIO_ESS: sum_r * sum_r / (n * sum_r2),
        K.RATIO_FRAC_ABOVE_C: s["ratio_above"] / n,
    }
    for i, t in enumerate(p.thresholds):
        out[K.frac_abs_diff_above(t)] = s[f"thr{i}"] / n

    mean_d, mean_lr = s["d"] / n, s["lr"] / n
    var_lr = max(s["lr2"] / n - mean_lr * mean_lr, 0.0)
    var_d = max(s["d2"] / n - mean_d * mean_d, 0.0)
    cov = s["dlr"] / n - mean_d * mean_lr
    out[K.SIG_SLOPE] = cov / var_lr if var_lr > 1e-12 else 0.0
    out[K.SIG_SLOPE_CORR] = max(min(cov / math.sqrt(var_lr * var_d), 1.0), -1.0) if var_lr * var_d > 1e-24 else 0.0

    sh_n = s["sh_n"]
    if sh_n > 0:
        base, ep, em = s["sh_e0"] / sh_n, s["sh_ep"] / sh_n, s["sh_em"] / sh_n
        out[K.SIG_SHIFT_BASE] = base
        out[K.SIG_SHIFT_GAIN] = base / max(min(ep, em), 1e-12)
        out[K.SIG_SHIFT_DIRECTION] = 1.0 if ep <= em else -1.0
    else:
        out.update({K.SIG_SHIFT_BASE: 0.0, K.SIG_SHIFT_GAIN: 0.0, K.SIG_SHIFT_DIRECTION: 0.0})
    return out
