"""Importance-sampling correction of the rollout/trainer mismatch, named and computed as verl's rollout
correction (`verl.trainer.ppo.rollout_corr_helper`) computes it, on rlcheck's packed tokens.

    c = report.correction(rollout_is="token", rollout_is_threshold=2.0)   # a `StepReport`'s step
    loss = (c.weights * per_token_loss)[c.mask].sum() / c.mask.sum()

With d = logp_train - logp_rollout per token (verl's log_ratio = old_log_prob - rollout_log_prob):

| setting                                  | weight / mask                                               | verl name          |
|------------------------------------------|-------------------------------------------------------------|--------------------|
| rollout_is="token", threshold=2.0        | w_t = min(exp(d_t), 2): token TIS with a cap                | token TIS          |
| rollout_is="sequence", threshold=2.0     | w = min(exp(sum d), 2) for each token of the sequence       | sequence TIS       |
| rollout_is="geometric", threshold=2.0    | w = min(exp(mean d), 2) for each token of the sequence      | geometric (0.6)    |
| rollout_is=..., threshold="0.5_2.0"      | the weight where it lies in [0.5, 2.0], else 0              | IcePop / MIS       |
| rollout_rs="seq_mean_k1", "0.9_1.1"      | drop the sequence unless exp(-mean d) lies in [0.9, 1.1]    | geometric-mean mask|
| rollout_rs="seq_mean_k3" (or token_k3,   | drop the sequence (token) whose mean (max, own) k3 =        | k3 rejection       |
| seq_max_k3), threshold=0.01              | exp(d) - 1 - d is past the threshold                        |                    |

Long episodes (multi-turn agents, 10^4 tokens and more): the sequence weight is the product of the
token ratios, so it collapses: a per-token mean d of 0.01 over 10,000 tokens is exp(100), and every
sequence's weight ends at the cap or (IcePop) at 0, its ESS at the few sequences that happen to sit
near d = 0. The geometric weight exp(mean d) does not grow with length (it stays near 1 when the
per-token mismatch is small): use "geometric" (or `seq_mean_k1` rejection) on long episodes,
"sequence" where the unbiased product is wanted and sequences are short. Both are computed in log
space and clamped to +-20 before any exponential (verl's SAFETY_BOUND), the metrics too: no length
overflows (`rlcheck.core.importance`).

Every option of verl's `rollout_rs` is here (token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3,
seq_max_k2/k3, comma-separated to chain them), with its threshold syntax (k1 = -d: its bounds are on
the rollout/train ratio, so "0.9_1.1" keeps exp(mean d) in [1/1.1, 1/0.9]); `rollout_is_batch_normalize`
divides the weights by their mean. The metrics carry verl's names (`rollout_is_eff_sample_size`,
`rollout_rs_masked_fraction`, ...); the Monitor logs them as `rlcheck/corr/<name>` when
`MonitorConfig.correction` is set. Quarantined sequences (`StepReport.keep`) and masked or non-finite
tokens are outside the response mask, and the per-sequence metrics (`*_seq_*`, the sequence-level
fractions) count only the sequences with a valid token (verl counts a fully masked row as a sequence
of weight 0). The metrics are finalized from a `Tally`, so a step held by several ranks is reduced
exactly (`rlcheck.distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.core.importance import LEVELS, is_metrics, is_tally, norm_factor, raw_weights
from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.rejection import EPS, TOKEN_RS, parse_rs, rs_mask, rs_metrics, rs_parts, seg_sum
from rlcheck.core.tally import Tally
from rlcheck.core.turn_correction import episode_d
from rlcheck.errors import ConfigError

PREFIX = "rlcheck/corr/"
__all__ = ["LEVELS", "PREFIX", "Correction", "CorrectionConfig", "batch_metrics", "compute", "correct",
           "is_weights", "metrics_of", "parse_is_threshold", "response_mask", "rs_mask", "sequence_weights"]


@dataclass(frozen=True)
class CorrectionConfig:
    """verl's `algorithm.rollout_correction` fields, with its defaults (all off)."""

    rollout_is: str | None = None
    """None, "token", "sequence" (the product of the token ratios) or "geometric" (their geometric mean,
    exp(mean d): the one that does not collapse on long episodes; see the module docstring)."""
    rollout_is_threshold: float | str = 2.0
    """A float: the TIS cap; "lower_upper": IcePop bounds (weights outside become 0)."""
    rollout_rs: str | None = None
    """Rejection: any of RS_OPTIONS, comma-separated."""
    rollout_rs_threshold: float | str | None = None
    """One threshold for all options or one per option; k1 options take "lower_upper" ratio bounds."""
    rollout_is_batch_normalize: bool = False

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in LEVELS:
            raise ConfigError(f"rollout_is must be None or one of {LEVELS}, got {self.rollout_is!r}")
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
    tally: Tally = field(default_factory=Tally, repr=False, compare=False)
    """What `metrics` were finalized from (`metrics_of`): the part several ranks merge."""

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
    tally = Tally()
    weights = np.ones_like(d) * m
    if cfg.rollout_is is not None:
        weights, found = is_parts(d, m, cu, cfg.rollout_is, cfg.rollout_is_threshold)
        tally.add(found)
    keep = mask
    if cfg.rollout_rs is not None:
        rs, found = rs_parts(d, m, cu, cfg.rollout_rs, cfg.rollout_rs_threshold)
        tally.add(found)
        keep = mask & (rs > 0.5)
    if cfg.rollout_is is not None and cfg.rollout_is_batch_normalize:
        factor = norm_factor(tally, cfg.rollout_is)
        weights = weights / factor if factor > EPS else weights
    metrics = metrics_of(tally, cfg)
    return Correction(np.where(keep, weights, 0.0).astype(np.float32), keep, metrics, tally)


def metrics_of(tally: Tally, cfg: CorrectionConfig) -> dict[str, float]:
    """verl's IS and RS metrics of `cfg` from a tally of `compute` (one batch's, or the ranks' merged);
    {} when it counted no valid token."""
    if not cfg.enabled or not tally.sums.get("is/tokens", tally.sums.get("rs/tokens", 0.0)):
        return {}
    out: dict[str, float] = {}
    if cfg.rollout_is is not None:
        upper, _ = parse_is_threshold(cfg.rollout_is_threshold)
        out.update(is_metrics(tally, cfg.rollout_is, upper))
        if cfg.rollout_is_batch_normalize:
            factor = norm_factor(tally, cfg.rollout_is)
            out["rollout_is_batch_norm_factor"] = factor if factor > EPS else 1.0
    if cfg.rollout_rs is not None:
        out.update(rs_metrics(tally, cfg.rollout_rs, cfg.rollout_rs_threshold))
    return out


def is_parts(d: np.ndarray, m: np.ndarray, cu: np.ndarray, level: str,
             threshold: float | str) -> tuple[np.ndarray, Tally]:
    """(weights (M,) before any batch normalization, their `Tally`): the TIS cap or the IcePop cut
    applied to the raw weights of `level` (`rlcheck.core.importance`)."""
    upper, lower = parse_is_threshold(threshold)
    raw, log_metrics = raw_weights(d, m, cu, level)
    w = np.minimum(raw, upper) if lower is None else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    return w, is_tally(w, raw, log_metrics, m, cu, level, upper, lower)


def is_weights(d: np.ndarray, m: np.ndarray, cu: np.ndarray, level: str, threshold: float | str,
               batch_normalize: bool = False) -> tuple[np.ndarray, dict[str, float]]:
    """verl's `compute_rollout_correction_weights` on packed tokens: (weights (M,), metrics)."""
    w, tally = is_parts(d, m, cu, level, threshold)
    upper, _ = parse_is_threshold(threshold)
    metrics = is_metrics(tally, level, upper)
    if batch_normalize:
        factor = norm_factor(tally, level)
        metrics["rollout_is_batch_norm_factor"] = factor if factor > EPS else 1.0
        w = w / metrics["rollout_is_batch_norm_factor"]
    return w, metrics


def correct(batch: Any, keep: np.ndarray | None, cfg: CorrectionConfig) -> Correction:
    """`cfg`'s correction of a StepBatch's tokens `response_mask(batch, keep)` counts."""
    mask = response_mask(batch, keep)
    d = batch.logp_train.astype(np.float64) - batch.logp_rollout
    d = episode_d(batch, d, mask, cfg.rollout_is)  # multi-turn: the sequence level is the per-token mean
    return compute(d, mask, batch.cu_seqlens, cfg)


def batch_metrics(batch: Any, keep: np.ndarray | None, cfg: CorrectionConfig) -> dict[str, float]:
    """The `rlcheck/corr/...` metrics of `cfg` on a StepBatch's kept, valid tokens ({} when off or none)."""
    return correct(batch, keep, cfg).prefixed() if cfg.enabled else {}


def sequence_weights(d: np.ndarray, mask: np.ndarray, cu: np.ndarray, keep: np.ndarray,
                     cfg: CorrectionConfig) -> np.ndarray:
    """(N,) float32 one weight per sequence: its sequence-level IS weight (1 without rollout_is) where
    it is kept (quarantine) and passes the sequence-level rejection, else 0."""
    return sequence_weights_of(compute(d, mask, cu, cfg), cu, keep, cfg)


def sequence_weights_of(c: Correction, cu: np.ndarray, keep: np.ndarray, cfg: CorrectionConfig) -> np.ndarray:
    """`sequence_weights` of a correction already computed."""
    if cfg.rollout_is == "token":
        raise ConfigError("sequence_weights takes rollout_is='sequence', 'geometric' or None; token weights: "
                          "token_weights")
    if cfg.rollout_rs is not None and any(o in TOKEN_RS for o in parse_rs(cfg.rollout_rs, cfg.rollout_rs_threshold)):
        raise ConfigError(f"sequence_weights takes sequence-level rejection only, got rollout_rs={cfg.rollout_rs!r}")
    counted = seg_sum(c.mask.astype(np.float64), cu)
    w = seg_sum(c.weights.astype(np.float64), cu) / np.maximum(counted, 1.0)
    return np.where((counted > 0) & keep, w, 0.0).astype(np.float32)
