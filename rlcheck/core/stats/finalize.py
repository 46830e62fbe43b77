"""finalize: metric dict (every value finite) and offenders from merged partial statistics.

A metric that is undefined for the step is absent, never NaN: the token, ratio, slope and shift
metrics and the seq/ means and maxima when no token is valid (every one masked or non-finite);
seq/first_div_* when no sequence diverged; sig/token_mismatch_* without token ids on both sides.
A slope or correlation whose variance is 0 or below rounding resolution is reported as 0.
"""

from __future__ import annotations

import math

from rlcheck.core import histogram as H
from rlcheck.core import metrics as K
from rlcheck.core.stats.distribution import distribution_metrics
from rlcheck.core.stats.turns import turn_metrics
from rlcheck.core.stats.types import RATIO_LOG_CAP, Offender, PartialStats, StatsConfig


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
        K.SIG_EARLY_ANY_COUNT: s["early_any"],
        # early divergences expected if the step's diverged tokens fell anywhere: q * early slots
        K.SIG_EARLY_ANY_EXPECTED: s["div_tokens"] / max(n, 1.0) * s["early_slots"],
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
    if s["res_n"] > 0:
        out[K.RESIDUAL_LEVEL] = s["res_sum"] / s["res_n"]
    if s["tw_groups"] > 0:
        out.update({K.SIG_TWIN_GROUPS: s["tw_groups"], K.SIG_TWIN_SPLIT: s["tw_split"],
                    K.SIG_TWIN_SPLIT_SEQS: s["tw_split_seqs"], K.SIG_TWIN_TRAINER_SPLIT: s["tw_trainer_split"],
                    K.SIG_TWIN_SPREAD: mx["tw_spread"], K.SIG_TWIN_ROUTED: float(s["tw_routed"] > 0),
                    K.SIG_TWIN_OFF: s["tw_off"], K.SIG_TWIN_OFF_SEQS: s["tw_off_seqs"], K.SIG_TWIN_OFF_GAP: mx["tw_off_gap"]})
        if math.isfinite(mn["tw_first_pos"]):
            out[K.SIG_TWIN_FIRST_POS] = mn["tw_first_pos"]
    out.update(distribution_metrics(s, mx))
    out.update(turn_metrics(s, mx))  # rlcheck/turn/*: multi-turn batches only
    return out, p.offenders


def _token_metrics(p: PartialStats, cfg: StatsConfig) -> dict[str, float]:
    s, mx, mn = p.sums, p.maxima, p.minima
    n = s["n"]
    mean_e, mean_e2 = s["e"] / n, s["e2"] / n
    mean_r, mean_r2 = s["r"] / n, s["r2"] / n
    # var r = var(r - 1), one-pass from the smaller second moment (less cancellation): e = r - 1 while
    # r ~ 1, r itself once every r is far below 1 (there e ~ -1 and e's variance is lost to rounding)
    var_r = mean_e2 - mean_e * mean_e if mean_e2 <= mean_r2 else mean_r2 - mean_r * mean_r
    ad_max = mx["ad"]
    out = {
        K.ABS_DIFF_MEAN: s["ad"] / n,
        K.ABS_DIFF_CLIPPED_MEAN: s["ad_clip"] / n,
        K.CATASTROPHIC_TOKEN_FRAC: s["cat_tok"] / n,
        K.ABS_DIFF_P50: H.quantile(p.hists["ad"], H.ABS_EDGES, 0.50, ad_max),
        K.ABS_DIFF_P90: H.quantile(p.hists["ad"], H.ABS_EDGES, 0.90, ad_max),
        K.ABS_DIFF_P99: H.quantile(p.hists["ad"], H.ABS_EDGES, 0.99, ad_max),
        K.ABS_DIFF_MAX: ad_max,
        K.DIFF_MEAN: s["d"] / n,
        K.KL_K1: -s["d"] / n,
        K.KL_K2: s["d2"] / (2.0 * n),
        K.KL_K3: max(s["k3"] / n, 0.0),
        K.CHI2: mean_e2 + 2.0 * mean_e,
        K.PROB_ABS_DIFF_MEAN: s["pdiff"] / n,
        K.PROB_ABS_DIFF_MAX: mx["pdiff"],
        K.MULT_PROB_ERROR: 1.0 + s["mpe"] / n,
        K.RATIO_MEAN: mean_r,  # = 1 + mean_e, without the cancellation where r << 1
        K.RATIO_STD: math.sqrt(max(var_r, 0.0)),
        K.RATIO_MIN: math.exp(max(min(mn["d"], RATIO_LOG_CAP), -700.0)),
        K.RATIO_MAX: math.exp(min(mx["d"], RATIO_LOG_CAP)),
        K.RATIO_ESS: s["r"] * s["r"] / (n * s["r2"]),  # s["r2"] > 0: r is floored (stats.partial)
        K.RATIO_FRAC_ABOVE_C: s["ratio_above"] / n,
    }
    for i, t in enumerate(p.thresholds):
        out[K.frac_abs_diff_above(t)] = s[f"thr{i}"] / n

    out.update(_slope_metrics(s, n))
    sh_n = s["sh_n"]
    if sh_n > 0:
        base, ep, em = s["sh_e0"] / sh_n, s["sh_ep"] / sh_n, s["sh_em"] / sh_n
        out[K.SIG_SHIFT_BASE] = base
        out[K.SIG_SHIFT_GAIN] = base / max(min(ep, em), 1e-12)
        out[K.SIG_SHIFT_DIRECTION] = 1.0 if ep <= em else -1.0
    else:
        out.update({K.SIG_SHIFT_BASE: 0.0, K.SIG_SHIFT_GAIN: 0.0, K.SIG_SHIFT_DIRECTION: 0.0})
    return out


# A one-pass variance E[x^2] - E[x]^2 is known to about 1e-15 E[x^2]; below this fraction of E[x^2] it
# is rounding noise (all logprobs ~ -9999 within 1e-5: a "slope" of noise over noise), reported as 0.
_RESOLVED = 1e-10


def _slope_metrics(s: dict[str, float], n: float) -> dict[str, float]:
    """Least-squares slope of d on logp_rollout and their correlation; 0 where a variance is 0 or
    below rounding resolution."""
    mean_d, mean_lr = s["d"] / n, s["lr"] / n
    var_lr = max(s["lr2"] / n - mean_lr * mean_lr, 0.0)
    var_d = max(s["d2"] / n - mean_d * mean_d, 0.0)
    cov = s["dlr"] / n - mean_d * mean_lr
    lr_ok = var_lr > max(1e-12, _RESOLVED * s["lr2"] / n)
    d_ok = var_d > _RESOLVED * s["d2"] / n and var_lr * var_d > 1e-24
    return {
        K.SIG_SLOPE: cov / var_lr if lr_ok else 0.0,
        K.SIG_SLOPE_CORR: max(min(cov / math.sqrt(var_lr * var_d), 1.0), -1.0) if lr_ok and d_ok else 0.0,
    }
