"""Rejection sampling of the rollout correction (verl's `rollout_rs`): drop the tokens or sequences
whose divergence estimate (k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d; per token, or a sequence's
sum, mean or max) is past its threshold, computed and named as verl's
`compute_rollout_rejection_mask` and `compute_rs_metrics` do, on packed tokens
with the packed reductions both share (`rlcheck.core.correction` holds the IS weights and the
config)."""

from __future__ import annotations

import math

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.tally import Tally
from rlcheck.errors import ConfigError

SAFETY_BOUND = 20.0  # verl's: d is clamped to +-20 before any exponential
EPS = 1e-8  # verl's masked_mean denominator guard

RS_OPTIONS = K.CORR_RS_OPTIONS
TOKEN_RS = ("token_k1", "token_k2", "token_k3")


def parse_rs(options: str, spec: float | str | None) -> dict[str, tuple[float | None, float]]:
    """option -> (lower, upper) as verl's `_parse_rollout_rs_thresholds` reads them (k1: ratio bounds,
    the lower 1/upper when not given; others: an upper bound only)."""
    opts = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [o for o in opts if o not in RS_OPTIONS]
    if not opts or unknown:
        raise ConfigError(f"rollout_rs must be options of {RS_OPTIONS}, comma-separated; got {options!r}")
    if spec is None:
        raise ConfigError("rollout_rs_threshold must be given with rollout_rs")
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(raw) not in (1, len(opts)):
        raise ConfigError(f"rollout_rs_threshold needs one value or {len(opts)}, got {spec!r}")
    raw = raw * len(opts) if len(raw) == 1 else raw
    out: dict[str, tuple[float | None, float]] = {}
    for opt, s in zip(opts, raw, strict=True):
        try:
            if opt.endswith("k1"):
                lo, up = (float(x) for x in s.split("_", 1)) if "_" in s else (1.0 / float(s), float(s))
                if not 0 < lo <= up:
                    raise ConfigError(f"rollout_rs_threshold for {opt}: need 0 < lower <= upper, got {s!r}")
                out[opt] = (lo, up)
            else:
                if "_" in s or not float(s) > 0:
                    raise ConfigError(f"rollout_rs_threshold for {opt} is one positive upper bound, got {s!r}")
                out[opt] = (None, float(s))
        except ValueError as exc:
            raise ConfigError(f"rollout_rs_threshold {s!r} for {opt} is not a number") from exc
    return out


def rs_mask(d: np.ndarray, m: np.ndarray, cu: np.ndarray, options: str,
            threshold: float | str | None) -> tuple[np.ndarray, dict[str, float]]:
    """verl's `compute_rollout_rejection_mask` on packed tokens: (mask * keep (M,) float, metrics)."""
    keep, tally = rs_parts(d, m, cu, options, threshold)
    return keep, rs_metrics(tally, options, threshold)


def rs_parts(d: np.ndarray, m: np.ndarray, cu: np.ndarray, options: str,
             threshold: float | str | None) -> tuple[np.ndarray, Tally]:
    """(mask * keep (M,) float, the `Tally` `rs_metrics` finalizes) of one part of a step."""
    specs = parse_rs(options, threshold)
    ls = np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -ls, "k2": 0.5 * ls**2, "k3": np.exp(ls) - 1.0 - ls}
    mb = m > 0
    valid = seg_sum(m, cu) > 0  # (N,) the sequences with a valid token
    combined = np.ones_like(d)
    t = Tally(sums={"rs/tokens": float(m.sum()), "rs/seqs": float(valid.sum())})
    for opt, (lo, up) in specs.items():
        k1 = opt.endswith("k1")
        lo_t, up_t = (math.log(lo), math.log(up)) if k1 else (0.0, up)
        tok = stats[opt[-2:]]
        if opt in TOKEN_RS:
            stat, seq_stat = tok, None
            keep = (stat >= lo_t) & (stat <= up_t) if k1 else stat <= up_t
        else:
            if opt.startswith("seq_sum"):
                seq_stat = seg_sum(tok * m, cu)
            elif opt.startswith("seq_mean"):
                seq_stat = seq_mean(tok, m, cu)
            else:
                seq_stat = seq_max(tok, mb, cu)
            seq_keep = (seq_stat >= lo_t) & (seq_stat <= up_t) if k1 else seq_stat <= up_t
            keep, stat = per_token(seq_keep, cu), per_token(seq_stat, cu)
        t.add(_option_tally(f"rs/{opt}/", stat, seq_stat, m, cu, valid, lo_t, up_t, k1))
        t.sums[f"rs/{opt}/masked"] = float((~keep & mb).sum())
        t.sums[f"rs/{opt}/seq_masked"] = float((seg_any(~keep & mb, cu) & valid).sum())
        combined *= keep
    final_keep = (combined > 0.5) & mb
    t.sums["rs/masked"] = float((~final_keep & mb).sum())
    t.sums["rs/seq_masked"] = float((seg_any(~final_keep & mb, cu) & valid).sum())
    return m * combined, t


def seg_any(flags: np.ndarray, cu: np.ndarray) -> np.ndarray:
    return seg_sum(flags.astype(np.float64), cu) > 0


def _option_tally(p: str, stat, seq_stat, m, cu, valid, lower, upper, k1) -> Tally:
    """The sums, maxima and minima of one option's statistic (`stat` per token; `seq_stat` per sequence,
    None for a token-level option): what verl's `compute_rs_metrics` reads."""
    mb = m > 0
    t = Tally()
    s = t.sums
    s[p + "stat"] = float((stat * m).sum())
    if seq_stat is not None:
        vals = seq_stat[valid]
        t.maxima[p + "stat"], t.minima[p + "stat"] = float(vals.max(initial=-np.inf)), float(vals.min(initial=np.inf))
        s[p + "high"], s[p + "low"] = float((vals > upper).sum()), float((vals < lower).sum())
    else:
        t.maxima[p + "stat"] = float(np.max(stat, where=mb, initial=-np.inf))
        t.minima[p + "stat"] = float(np.min(stat, where=mb, initial=np.inf))
        s[p + "high"], s[p + "low"] = float(((stat > upper) & mb).sum()), float(((stat < lower) & mb).sum())
    clipped = np.clip(stat, lower if k1 else 0.0, upper)
    s[p + "c"], s[p + "c2"] = float((clipped * m).sum()), float((clipped * clipped * m).sum())
    seq_values = (seq_stat if seq_stat is not None else seq_mean(stat, m, cu))[valid]
    s[p + "seq"], s[p + "seq2"] = float(seq_values.sum()), float((seq_values * seq_values).sum())
    t.maxima[p + "seq"] = float(seq_values.max(initial=-np.inf))
    t.minima[p + "seq"] = float(seq_values.min(initial=np.inf))
    s[p + "seq_high"], s[p + "seq_low"] = float((seq_values > upper).sum()), float((seq_values < lower).sum())
    return t


def rs_metrics(t: Tally, options: str, threshold: float | str | None) -> dict[str, float]:
    """verl's RS metrics of a (merged) `rs_parts` tally; the sequence fractions count the sequences
    with a valid token."""
    s = t.sums
    n, num_seqs = s["rs/tokens"], s["rs/seqs"]
    out: dict[str, float] = {}
    for opt in parse_rs(options, threshold):
        out.update(_option_metrics(t, opt, n, num_seqs))
        out[f"rollout_rs_{opt}_masked_fraction"] = s[f"rs/{opt}/masked"] / (n + EPS)
        out[f"rollout_rs_{opt}_seq_masked_fraction"] = s[f"rs/{opt}/seq_masked"] / num_seqs if num_seqs else 0.0
    out["rollout_rs_masked_fraction"] = s["rs/masked"] / (n + EPS)
    out["rollout_rs_seq_masked_fraction"] = s["rs/seq_masked"] / num_seqs if num_seqs else 0.0
    return out


def _option_metrics(t: Tally, opt: str, n: float, num_seqs: float) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one option, from its tally."""
    p, q, s = f"rollout_rs_{opt}", f"rs/{opt}/", t.sums
    k1, sequence = opt.endswith("k1"), opt not in TOKEN_RS and num_seqs > 0
    mean_c = s[q + "c"] / (n + EPS)
    out = {
        f"{p}_mean": s[q + "stat"] / (n + EPS),
        f"{p}_max": t.maxima[q + "stat"],
        f"{p}_min": t.minima[q + "stat"],
        f"{p}_fraction_high": s[q + "high"] / (num_seqs if sequence else n + EPS),
        f"{p}_fraction_low": s[q + "low"] / (num_seqs if sequence else n + EPS) if k1 else 0.0,
        f"{p}_std": math.sqrt(max(s[q + "c2"] / (n + EPS) - mean_c**2, 0.0)) if n > 1 else 0.0,
    }
    if not num_seqs:
        out.update({f"{p}_{k}": 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                              "seq_fraction_high", "seq_fraction_low")})
        return out
    total, sq = s[q + "seq"], s[q + "seq2"]
    var = (sq - total**2 / num_seqs) / (num_seqs - 1) if num_seqs > 1 else 0.0
    top, bottom = t.maxima[q + "seq"], t.minima[q + "seq"]
    out.update({
        f"{p}_seq_mean": total / num_seqs, f"{p}_seq_std": math.sqrt(max(var, 0.0)),
        f"{p}_seq_max": top, f"{p}_seq_min": bottom, f"{p}_seq_max_deviation": max(abs(top), abs(bottom)),
        f"{p}_seq_fraction_high": s[q + "seq_high"] / num_seqs,
    })
    if k1:
        out[f"{p}_seq_fraction_low"] = s[q + "seq_low"] / num_seqs
    return out


# ---- packed reductions (verl's masked_sum / masked_mean, per sequence and over the batch; shared with the IS weights)

def seg_sum(x: np.ndarray, cu: np.ndarray) -> np.ndarray:
    out = np.zeros(cu.shape[0] - 1, dtype=np.float64)
    lens = np.diff(cu)
    nonempty = lens > 0
    if nonempty.any():
        out[nonempty] = np.add.reduceat(x.astype(np.float64, copy=False), cu[:-1][nonempty])
    return out


def masked_mean(x: np.ndarray, m: np.ndarray) -> float:
    return float(np.sum(x * m, dtype=np.float64) / (m.sum(dtype=np.float64) + EPS))


def seq_mean(x: np.ndarray, m: np.ndarray, cu: np.ndarray) -> np.ndarray:
    return seg_sum(x * m, cu) / (seg_sum(m, cu) + EPS)


def seq_max(x: np.ndarray, mb: np.ndarray, cu: np.ndarray) -> np.ndarray:
    masked = np.where(mb, x, -np.inf)
    out = np.full(cu.shape[0] - 1, -np.inf)
    lens = np.diff(cu)
    nonempty = lens > 0
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(masked, cu[:-1][nonempty])
    return np.where(out == -np.inf, 0.0, out)


def sample_std(v: np.ndarray) -> float:
    return float(np.std(v, ddof=1)) if v.size > 1 else 0.0


def per_token(seq_values: np.ndarray, cu: np.ndarray) -> np.ndarray:
    return np.repeat(seq_values, np.diff(cu))
