"""Importance-sampling correction of the rollout/trainer mismatch, named and computed as verl's rollout
correction (`verl.trainer.ppo.rollout_corr_helper`) computes it, on rlcheck's packed tokens.

    c = report.correction(rollout_is="token", rollout_is_threshold=2.0)   # a `StepReport`'s step
    loss = (c.weights * per_token_loss)[c.mask].sum() / c.mask.sum()

With d = logp_train - logp_rollout per token (verl's log_ratio = old_log_prob - rollout_log_prob):

| setting                                  | weight / mask                                               | verl name          |
|------------------------------------------|-------------------------------------------------------------|--------------------|
| rollout_is="token", threshold=2.0        | w_t = min(exp(d_t), 2): token TIS with a cap                | token TIS          |
| rollout_is="sequence", threshold=2.0     | w = min(exp(sum d), 2) for each token of the sequence       | sequence TIS       |
| rollout_is=..., threshold="0.5_2.0"      | the weight where it lies in [0.5, 2.0], else 0              | IcePop / MIS       |
| rollout_rs="seq_mean_k1", "0.9_1.1"      | drop the sequence unless exp(-mean d) lies in [0.9, 1.1]    | geometric-mean mask|
| rollout_rs="seq_mean_k3" (or token_k3,   | drop the sequence (token) whose mean (max, own) k3 =        | k3 rejection       |
| seq_max_k3), threshold=0.01              | exp(d) - 1 - d is past the threshold                        |                    |

Every option of verl's `rollout_rs` is here (token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3,
seq_max_k2/k3, comma-separated to chain them), with its threshold syntax (k1 = -d: its bounds are on
the rollout/train ratio, so "0.9_1.1" keeps exp(mean d) in [1/1.1, 1/0.9]); `rollout_is_batch_normalize`
divides the weights by their mean. d is clamped to +-20 before any exponential (verl's SAFETY_BOUND).
The metrics carry verl's names (`rollout_is_eff_sample_size`, `rollout_rs_masked_fraction`, ...);
the Monitor logs them as `rlcheck/corr/<name>` when `MonitorConfig.correction` is set. Quarantined
sequences (`StepReport.keep`) and masked or non-finite tokens are outside the response mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.rejection import (
    EPS,
    SAFETY_BOUND,
    TOKEN_RS,
    masked_mean,
    parse_rs,
    per_token,
    rs_mask,
    sample_std,
    seg_sum,
    seq_mean,
)
from rlcheck.core.turn_correction import episode_d
from rlcheck.errors import ConfigError

PREFIX = "rlcheck/corr/"



@dataclass(frozen=True)
class CorrectionConfig:
    """verl's `algorithm.rollout_correction` fields, with its defaults (all off)."""

    rollout_is: str | None = None
    """None, "token" or "sequence"."""
    rollout_is_threshold: float | str = 2.0
    """A float: the TIS cap; "lower_upper": IcePop bounds (weights outside become 0)."""
    rollout_rs: str | None = None
    """Rejection: any of RS_OPTIONS, comma-separated."""
    rollout_rs_threshold: float | str | None = None
    """One threshold for all options or one per option; k1 options take "lower_upper" ratio bounds."""
    rollout_is_batch_normalize: bool = False

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in ("token", "sequence"):
            raise ConfigError(f"rollout_is must be None, 'token' or 'sequence', got {self.rollout_is!r}")
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs(self.rollout_rs, self.rollout_rs_threshold)

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass(frozen=True)
class Correction:
    """One step's correction: per token (packed like the batch) the IS weight and the response mask
    (valid, kept, not rejected); `metrics` named as verl names them."""

    weights: np.ndarray  # (M,) float32: the IS weight (1 without rollout_is), 0 outside `mask`
    mask: np.ndarray  # (M,) bool
    metrics: dict[str, float]

    def prefixed(self) -> dict[str, float]:
        return {PREFIX + k: v for k, v in self.metrics.items()}


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """(upper, lower or None): verl's `_parse_rollout_is_threshold`."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ConfigError(f"rollout_is_threshold must be a number or 'lower_upper', got {spec!r}")
    try:
        if isinstance(spec, str) and "_" in spec:
            lo, up = (float(x) for x in spec.strip().split("_", 1))
        else:
            lo, up = None, float(spec)
    except ValueError as exc:
        raise ConfigError(f"rollout_is_threshold {spec!r} is not a number or 'lower_upper'") from exc
    if not up > 0 or (lo is not None and not 0 < lo <= up):
        raise ConfigError(f"rollout_is_threshold {spec!r}: need 0 < lower <= upper")
    return up, lo


def response_mask(batch: Any, keep: np.ndarray | None = None) -> np.ndarray:
    """(M,) bool: the tokens a correction counts: compared (`batch.mask`), finite on both sides, of a
    sequence `keep` (N,) keeps."""
    with np.errstate(invalid="ignore"):
        out = (batch.logp_rollout >= MIN_LOGPROB) & (batch.logp_train >= MIN_LOGPROB)
    if batch.mask is not None:
        out &= batch.mask
    if keep is not None:
        out &= np.repeat(np.asarray(keep, dtype=bool), np.diff(batch.cu_seqlens))
    return out


# ---- the correction -----------------------------------------------------------------------------------

def compute(d: np.ndarray, mask: np.ndarray, cu: np.ndarray, cfg: CorrectionConfig) -> Correction:
    """The IS weights, the rejection-sampled mask and their metrics of one packed batch: `d` (M,)
    logp_train - logp_rollout (any value where `mask` is False), `mask` (M,) bool, `cu` (N+1,)."""
    d = np.where(mask, d, 0.0).astype(np.float64)
    m = mask.astype(np.float64)
    metrics: dict[str, float] = {}
    weights = np.ones_like(d) * m
    if cfg.rollout_is is not None:
        weights, found = is_weights(d, m, cu, cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize)
        metrics.update(found)
    keep = mask
    if cfg.rollout_rs is not None:
        rs, found = rs_mask(d, m, cu, cfg.rollout_rs, cfg.rollout_rs_threshold)
        metrics.update(found)
        keep = mask & (rs > 0.5)
    return Correction(np.where(keep, weights, 0.0).astype(np.float32), keep, metrics)


def is_weights(d: np.ndarray, m: np.ndarray, cu: np.ndarray, level: str, threshold: float | str,
               batch_normalize: bool = False) -> tuple[np.ndarray, dict[str, float]]:
    """verl's `compute_rollout_correction_weights` on packed tokens: (weights (M,), metrics)."""
    upper, lower = parse_is_threshold(threshold)
    if level == "token":
        log_for_metrics = d
        raw = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        log_for_metrics = seg_sum(d * m, cu)  # (N,)
        raw = per_token(np.exp(np.clip(log_for_metrics, -SAFETY_BOUND, SAFETY_BOUND)), cu)
    else:
        raise ConfigError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
    raw = raw * m
    if lower is None:
        w = np.minimum(raw, upper)
    else:
        w = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = _is_metrics(w, raw, log_for_metrics, m, cu, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).astype(np.float64), m)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(w, m)
        else:
            seq_w, seq_m = seq_mean(w, m, cu), (seg_sum(m, cu) > 0).astype(np.float64)
            mean = float((seq_w * seq_m).sum() / max(seq_m.sum(), EPS))
        if mean > EPS:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = mean
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def _is_metrics(w, raw, log_for_metrics, m, cu, level, upper, lower) -> dict[str, float]:
    """verl's `compute_is_metrics`."""
    lower = 1.0 / upper if lower is None else lower
    mb = m > 0
    out: dict[str, float] = {}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(float(log_for_metrics.max()), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(log_for_metrics.min()))
        out["rollout_is_mean"] = masked_mean(w, m)
        out["rollout_is_ratio_fraction_high"] = float(np.mean(log_for_metrics > math.log(upper)))
        out["rollout_is_ratio_fraction_low"] = float(np.mean(log_for_metrics < math.log(lower)))
    else:
        out["rollout_is_mean"] = masked_mean(w, m)
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).astype(np.float64), m)
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).astype(np.float64), m)
        out["rollout_is_max"] = float(np.max(w, where=mb, initial=-np.inf))
        out["rollout_is_min"] = float(np.min(w, where=mb, initial=np.inf))
    clamped = np.clip(w, 0.0, upper)
    mean_c = masked_mean(clamped, m)
    if m.sum() > 1:
        out["rollout_is_std"] = math.sqrt(max(masked_mean(clamped**2, m) - mean_c**2, 0.0))
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((clamped / (mean_c + EPS)) ** 2, m)
    seq_w = seq_mean(w, m, cu)
    out["rollout_is_seq_mean"] = float(seq_w.mean())
    out["rollout_is_seq_std"] = sample_std(seq_w)
    out["rollout_is_seq_max"] = float(seq_w.max())
    out["rollout_is_seq_min"] = float(seq_w.min())
    out["rollout_is_seq_max_deviation"] = float(np.abs(seq_w - 1.0).max())
    raw_seq = seq_mean(raw, m, cu)
    out["rollout_is_seq_fraction_high"] = float(np.mean(raw_seq > upper))
    out["rollout_is_seq_fraction_low"] = float(np.mean(raw_seq < lower))
    return out


def correct(batch: Any, keep: np.ndarray | None, cfg: CorrectionConfig) -> Correction:
    """`cfg`'s correction of a StepBatch's tokens `response_mask(batch, keep)` counts."""
    mask = response_mask(batch, keep)
    d = batch.logp_train.astype(np.float64) - batch.logp_rollout
    d = episode_d(batch, d, mask, cfg.rollout_is)  # multi-turn: the sequence level is the per-token mean
    return compute(d, mask, batch.cu_seqlens, cfg)


def batch_metrics(batch: Any, keep: np.ndarray | None, cfg: CorrectionConfig) -> dict[str, float]:
    """The `rlcheck/corr/...` metrics of `cfg` on a StepBatch's kept, valid tokens ({} when off or none)."""
    if not cfg.enabled or not response_mask(batch, keep).any():
        return {}
    return correct(batch, keep, cfg).prefixed()


def sequence_weights(d: np.ndarray, mask: np.ndarray, cu: np.ndarray, keep: np.ndarray,
                     cfg: CorrectionConfig) -> np.ndarray:
    """(N,) float32 one weight per sequence: its sequence-level IS weight (1 without rollout_is) where
    it is kept (quarantine) and passes the sequence-level rejection, else 0."""
    if cfg.rollout_is == "token":
        raise ConfigError("sequence_weights takes rollout_is='sequence' or None; token weights: token_weights")
    if cfg.rollout_rs is not None and any(o in TOKEN_RS for o in parse_rs(cfg.rollout_rs, cfg.rollout_rs_threshold)):
        raise ConfigError(f"sequence_weights takes sequence-level rejection only, got rollout_rs={cfg.rollout_rs!r}")
    c = compute(d, mask, cu, cfg)
    w = seg_sum(c.weights.astype(np.float64), cu) / np.maximum(seg_sum(c.mask.astype(np.float64), cu), 1.0)
    passed = seg_sum(c.mask.astype(np.float64), cu) > 0
    return np.where(passed & keep, w, 0.0).astype(np.float32)
