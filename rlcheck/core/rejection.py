"""Rejection sampling of the rollout correction (verl's `rollout_rs`): drop the tokens or sequences
whose divergence estimate (k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d; per token, or a sequence's
sum, mean or max) is past its threshold, computed and named as verl's
`compute_rollout_rejection_mask` and `compute_rs_metrics` do, on packed tokens
with the packed reductions both share (`rlcheck.core.correction` holds the IS weights and the
config)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlcheck.errors import ConfigError

SAFETY_BOUND = 20.0  # verl's: d is clamped to +-20 before any exponential
EPS = 1e-8  # verl's masked_mean denominator guard

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
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
    specs = parse_rs(options, threshold)
    ls = np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -ls, "k2": 0.5 * ls**2, "k3": np.exp(ls) - 1.0 - ls}
    mb = m > 0
    counts = seg_sum(m, cu)
    seq_valid = counts > 0
    combined = np.ones_like(d)
    metrics: dict[str, float] = {}
    for opt, (lo, up) in specs.items():
        k1 = opt.endswith("k1")
        lo_t, up_t = (math.log(lo), math.log(up)) if k1 else (None, up)
        tok = stats[opt[-2:]]
        seq_stat = None
        if opt in TOKEN_RS:
            stat = tok
            keep = (stat >= lo_t) & (stat <= up_t) if k1 else stat <= up_t
        else:
            if opt.startswith("seq_sum"):
                seq_stat = seg_sum(tok * m, cu)
            elif opt.startswith("seq_mean"):
                seq_stat = seq_mean(tok, m, cu)
            else:
                seq_stat = seq_max(tok, mb, cu)
            seq_keep = (seq_stat >= lo_t) & (seq_stat <= up_t) if k1 else seq_stat <= up_t
            keep = per_token(seq_keep, cu)
            stat = per_token(seq_stat, cu)
        metrics.update(_rs_metrics(opt, stat, m, cu, seq_valid, seq_stat, up_t, lo_t if k1 else 0.0, k1))
        keep_f = keep.astype(np.float64)
        combined *= keep_f
        metrics[f"rollout_rs_{opt}_masked_fraction"] = masked_mean(1.0 - keep_f, m)
        seq_keep_all = ~seg_any(~keep & mb, cu)
        if seq_valid.any():
            metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = float(
                ((~seq_keep_all) & seq_valid).sum() / seq_valid.sum())
        else:
            metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = 0.0
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - combined, m)
    final_keep = (combined > 0.5) & mb
    metrics["rollout_rs_seq_masked_fraction"] = float(np.mean(seg_any(~final_keep & mb, cu)))
    return m * combined, metrics


def seg_any(flags: np.ndarray, cu: np.ndarray) -> np.ndarray:
    return seg_sum(flags.astype(np.float64), cu) > 0


def _rs_metrics(opt, stat, m, cu, seq_valid, seq_stat, upper, lower, apply_lower) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one option."""
    p = f"rollout_rs_{opt}"
    mb = m > 0
    seq_values = seq_stat if seq_stat is not None else seq_mean(stat, m, cu)
    valid_vals = seq_values[seq_valid]
    sequence = seq_stat is not None and valid_vals.size > 0
    out: dict[str, Any] = {f"{p}_mean": masked_mean(stat, m)}
    if sequence:
        out[f"{p}_max"], out[f"{p}_min"] = float(valid_vals.max()), float(valid_vals.min())
        out[f"{p}_fraction_high"] = float(np.mean(valid_vals > upper))
        out[f"{p}_fraction_low"] = float(np.mean(valid_vals < lower)) if apply_lower else 0.0
    else:
        out[f"{p}_max"] = float(np.max(stat, where=mb, initial=-np.inf))
        out[f"{p}_min"] = float(np.min(stat, where=mb, initial=np.inf))
        out[f"{p}_fraction_high"] = masked_mean((stat > upper).astype(np.float64), m)
        out[f"{p}_fraction_low"] = masked_mean((stat < lower).astype(np.float64), m) if apply_lower else 0.0
    if m.sum() > 1:
        s = np.clip(stat, lower if apply_lower else 0.0, upper)
        out[f"{p}_std"] = math.sqrt(max(masked_mean(s**2, m) - masked_mean(s, m) ** 2, 0.0))
    else:
        out[f"{p}_std"] = 0.0
    if valid_vals.size:
        out[f"{p}_seq_mean"] = float(valid_vals.mean())
        out[f"{p}_seq_std"] = sample_std(valid_vals)
        out[f"{p}_seq_max"], out[f"{p}_seq_min"] = float(valid_vals.max()), float(valid_vals.min())
        out[f"{p}_seq_max_deviation"] = float(np.abs(valid_vals).max())
        out[f"{p}_seq_fraction_high"] = float(np.mean(valid_vals > upper))
        if apply_lower:
            out[f"{p}_seq_fraction_low"] = float(np.mean(valid_vals < lower))
    else:
        out.update({f"{p}_{k}": 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                              "seq_fraction_high", "seq_fraction_low")})
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
