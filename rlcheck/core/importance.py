"""Importance-sampling weights of the rollout correction (verl's `rollout_is`), in log space, and their
metrics, computed and named as verl's `compute_rollout_correction_weights` and `compute_is_metrics` do,
on packed tokens (`rlcheck.core.correction` holds the config and the public API).

With d = logp_train - logp_rollout per token and a sequence's valid tokens t = 1..T:

    token       w_t = exp(d_t)                      per token
    sequence    w   = exp(sum_t d_t)                the product of the token ratios (verl's "sequence")
    geometric   w   = exp(mean_t d_t)               their geometric mean (verl's earlier "geometric" level)

Every log weight is clamped to +-SAFETY_BOUND (20, verl's) before the exponential, and the metrics
that verl reads off the unclamped log ratio (the sequence-level max and min) are clamped at both
ends too, so no sequence length overflows (a 32k-token sequence at mean d 0.03 sums to ~1000).

The metrics are finalized from a `Tally` (sums, maxima, minima), so the ranks of a step combine
exactly (`rlcheck.distributed`); per-sequence metrics count the sequences with at least one valid
token (a quarantined or fully masked sequence is not a sequence of weight 0)."""

from __future__ import annotations

import math

import numpy as np

from rlcheck.core.rejection import EPS, SAFETY_BOUND, per_token, seg_sum, seq_mean
from rlcheck.core.tally import Tally
from rlcheck.errors import ConfigError

LEVELS = ("token", "sequence", "geometric")
SEQUENCE_LEVELS = ("sequence", "geometric")


def log_weights(d: np.ndarray, m: np.ndarray, cu: np.ndarray, level: str) -> tuple[np.ndarray, np.ndarray]:
    """(log weight per token (M,), the log ratio the metrics read: per token (M,) or per sequence (N,)),
    unclamped; `d` is 0 where `m` is 0."""
    if level == "token":
        return d, d
    if level not in SEQUENCE_LEVELS:
        raise ConfigError(f"rollout_is must be one of {LEVELS}, got {level!r}")
    log_seq = seg_sum(d * m, cu)  # (N,)
    if level == "geometric":
        log_seq = log_seq / np.maximum(seg_sum(m, cu), 1.0)
    return per_token(log_seq, cu), log_seq


def raw_weights(d: np.ndarray, m: np.ndarray, cu: np.ndarray, level: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw weights (M,), 0 off the mask, the log ratio of the metrics (`log_weights`))."""
    log_w, log_metrics = log_weights(d, m, cu, level)
    return np.exp(np.clip(log_w, -SAFETY_BOUND, SAFETY_BOUND)) * m, log_metrics


def is_tally(w: np.ndarray, raw: np.ndarray, log_metrics: np.ndarray, m: np.ndarray, cu: np.ndarray, level: str,
             upper: float, lower: float | None) -> Tally:
    """The sums, maxima and minima `is_metrics` finalizes (verl's `compute_is_metrics` on one part of a step)."""
    low = 1.0 / upper if lower is None else lower
    mb = m > 0
    valid = seg_sum(m, cu) > 0  # (N,) the sequences with a valid token
    c = np.clip(w, 0.0, upper)
    t = Tally()
    s = t.sums
    s.update({"is/tokens": float(m.sum()), "is/seqs": float(valid.sum()), "is/w": float((w * m).sum()),
              "is/c": float((c * m).sum()), "is/c2": float((c * c * m).sum())})
    if level == "token":
        s["is/high"] = float(((raw > upper) & mb).sum())
        s["is/low"] = float(((raw < low) & mb).sum())
        t.maxima["is/w"] = float(np.max(w, where=mb, initial=-np.inf))
        t.minima["is/w"] = float(np.min(w, where=mb, initial=np.inf))
    else:
        logs = log_metrics[valid]
        s["is/high"] = float((logs > math.log(upper)).sum())
        s["is/low"] = float((logs < math.log(low)).sum())
        t.maxima["is/log"] = float(logs.max(initial=-np.inf))
        t.minima["is/log"] = float(logs.min(initial=np.inf))
    seq_w = seq_mean(w, m, cu)[valid] - 1.0  # (n,) shifted by 1: the weights sit near it
    s["is/seq_w"], s["is/seq_w2"] = float(seq_w.sum()), float((seq_w * seq_w).sum())
    t.maxima["is/seq_w"] = float(seq_w.max(initial=-np.inf)) + 1.0
    t.minima["is/seq_w"] = float(seq_w.min(initial=np.inf)) + 1.0
    raw_seq = seq_mean(raw, m, cu)[valid]
    s["is/seq_high"], s["is/seq_low"] = float((raw_seq > upper).sum()), float((raw_seq < low).sum())
    if lower is not None:
        s["is/oob"] = float((((raw < lower) | (raw > upper)) & mb).sum())
    return t


def is_metrics(t: Tally, level: str, upper: float) -> dict[str, float]:
    """verl's IS metrics of a (merged) `is_tally`."""
    s = t.sums
    n, num_seqs = s["is/tokens"], s["is/seqs"]
    out = {"rollout_is_mean": s["is/w"] / (n + EPS)}
    if level == "token":
        out["rollout_is_max"], out["rollout_is_min"] = t.maxima["is/w"], t.minima["is/w"]
        out["rollout_is_ratio_fraction_high"] = s["is/high"] / (n + EPS)
        out["rollout_is_ratio_fraction_low"] = s["is/low"] / (n + EPS)
    else:
        out["rollout_is_max"] = math.exp(min(max(t.maxima["is/log"], -SAFETY_BOUND), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(min(max(t.minima["is/log"], -SAFETY_BOUND), SAFETY_BOUND))
        out["rollout_is_ratio_fraction_high"] = s["is/high"] / max(num_seqs, 1.0)
        out["rollout_is_ratio_fraction_low"] = s["is/low"] / max(num_seqs, 1.0)
    mean_c = s["is/c"] / (n + EPS)
    out["rollout_is_std"] = math.sqrt(max(s["is/c2"] / (n + EPS) - mean_c**2, 0.0)) if n > 1 else 0.0
    second = s["is/c2"] / (mean_c + EPS) ** 2 / (n + EPS)
    out["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0  # every weight 0: none effective
    out.update(_seq_metrics(t, num_seqs))
    if "is/oob" in s:
        out["rollout_is_oob_ratio"] = s["is/oob"] / (n + EPS)
    return out


def _seq_metrics(t: Tally, num_seqs: float) -> dict[str, float]:
    """The per-sequence weight metrics, over the sequences with a valid token."""
    if num_seqs == 0:
        return {f"rollout_is_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation",
                                                      "fraction_high", "fraction_low")}
    s = t.sums
    shifted_sum, shifted_sq = s["is/seq_w"], s["is/seq_w2"]
    var = (shifted_sq - shifted_sum**2 / num_seqs) / (num_seqs - 1) if num_seqs > 1 else 0.0
    top, bottom = t.maxima["is/seq_w"], t.minima["is/seq_w"]
    return {
        "rollout_is_seq_mean": 1.0 + shifted_sum / num_seqs,
        "rollout_is_seq_std": math.sqrt(max(var, 0.0)),
        "rollout_is_seq_max": top,
        "rollout_is_seq_min": bottom,
        "rollout_is_seq_max_deviation": max(abs(top - 1.0), abs(bottom - 1.0)),
        "rollout_is_seq_fraction_high": s["is/seq_high"] / num_seqs,
        "rollout_is_seq_fraction_low": s["is/seq_low"] / num_seqs,
    }


def norm_factor(t: Tally, level: str) -> float:
    """verl's `rollout_is_batch_normalize` divisor: the mean weight over the valid tokens (token level) or
    over the sequences with a valid token (sequence levels), of a (merged) `is_tally`."""
    s = t.sums
    if level == "token":
        return s["is/w"] / (s["is/tokens"] + EPS)
    return (s["is/seq_w"] + s["is/seqs"]) / max(s["is/seqs"], EPS)
