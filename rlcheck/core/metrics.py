"""Metric key names: defined once, here. Every key the monitor logs starts with `rlcheck/`.

Groups: `token/` (per-token d = logp_train - logp_rollout), `ratio/` (importance ratio r = exp(d),
raw, before any clipping), `seq/` (per-sequence reductions), `sig/` (statistics the signature
detectors read), `dist/` (beyond the sampled token: top-K overlap and KL, `rlcheck.core.stats.distribution`),
`turn/` (multi-turn rollouts: per turn, head vs body, the cross-turn invariants), `moe/`, `quarantine/`, `weights/` and `corr/` (the correction, verl's names). The end of the module
says which names a rule may watch (`check_names`): a new key is a constant here, a new family of
keys one entry of `FAMILIES`.
"""

from __future__ import annotations

import difflib
import re

PREFIX = "rlcheck/"

# token level
TOKEN_COUNT = "rlcheck/token/count"
TOKEN_MASKED_COUNT = "rlcheck/token/masked_count"
NONFINITE_COUNT = "rlcheck/token/nonfinite_count"
ABS_DIFF_MEAN = "rlcheck/token/abs_diff_mean"
ABS_DIFF_CLIPPED_MEAN = "rlcheck/token/abs_diff_clipped_mean"  # mean min(|d|, StatsConfig.clip)
CATASTROPHIC_TOKEN_FRAC = "rlcheck/token/catastrophic_frac"  # tokens with |d| >= catastrophic_tau
ABS_DIFF_P50 = "rlcheck/token/abs_diff_p50"
ABS_DIFF_P90 = "rlcheck/token/abs_diff_p90"
ABS_DIFF_P99 = "rlcheck/token/abs_diff_p99"
ABS_DIFF_MAX = "rlcheck/token/abs_diff_max"
DIFF_MEAN = "rlcheck/token/diff_mean"
KL_K1 = "rlcheck/token/kl_k1"
KL_K2 = "rlcheck/token/kl_k2"
KL_K3 = "rlcheck/token/kl_k3"
CHI2 = "rlcheck/token/chi2"
PROB_ABS_DIFF_MEAN = "rlcheck/token/prob_abs_diff_mean"
PROB_ABS_DIFF_MAX = "rlcheck/token/prob_abs_diff_max"
MULT_PROB_ERROR = "rlcheck/token/mult_prob_error"

# importance ratio
RATIO_MEAN = "rlcheck/ratio/mean"
RATIO_STD = "rlcheck/ratio/std"
RATIO_MIN = "rlcheck/ratio/min"
RATIO_MAX = "rlcheck/ratio/max"
RATIO_ESS = "rlcheck/ratio/ess"
RATIO_FRAC_ABOVE_C = "rlcheck/ratio/frac_above_c"
RATIO_CLIPPED_COUNT = "rlcheck/ratio/clipped_count"

# sequence level
SEQ_COUNT = "rlcheck/seq/count"
SEQ_EMPTY_COUNT = "rlcheck/seq/empty_count"
SEQ_MAX_ABS_DIFF_MEAN = "rlcheck/seq/max_abs_diff_mean"
SEQ_MAX_ABS_DIFF_MAX = "rlcheck/seq/max_abs_diff_max"
SEQ_LOG_RATIO_MEAN = "rlcheck/seq/log_ratio_mean"
SEQ_LOG_RATIO_ABS_MAX = "rlcheck/seq/log_ratio_abs_max"
SEQ_LOG_PPL_DIFF_MEAN = "rlcheck/seq/log_ppl_diff_mean"
SEQ_LOG_PPL_DIFF_ABS_MAX = "rlcheck/seq/log_ppl_diff_abs_max"
SEQ_FLAGGED_FRAC = "rlcheck/seq/flagged_frac"
SEQ_CATASTROPHIC_COUNT = "rlcheck/seq/catastrophic_count"
SEQ_CATASTROPHIC_FRAC = "rlcheck/seq/catastrophic_frac"
FIRST_DIV_MIN = "rlcheck/seq/first_div_min"
FIRST_DIV_P50 = "rlcheck/seq/first_div_p50"
RESIDUAL_LEVEL = "rlcheck/token/residual_level"  # mean |d| (clipped) over (1 - p)^0.91: the token mix out (`stats.residual`)
SEQ_LEVEL_SPREAD = "rlcheck/seq/level_spread"  # p90 - p50 of the sequences' log residual levels (`stats.levels`)
PROBE_LEVEL = "rlcheck/probe/abs_diff_clipped_mean"  # the sync check's fixed probe batch, when observed with one
FLOOR_LEVEL = "rlcheck/floor/level"  # the run's precision floor: a healthy clipped mean |d| stays under it (`core.floors`)
FLOOR_SCALE = "rlcheck/floor/scale"  # ... over the bf16 floor the detectors' defaults were set at
FLOOR_MEASURED = "rlcheck/floor/measured"  # the model's own noise at the engine's precision, the trainer's measure this step (`core.floors`)
FLOOR_EXCESS = "rlcheck/floor/excess"  # the step's clipped mean |d| over the larger of floor/measured and floor/level (`core.floors`)

# signature statistics
SIG_SLOPE = "rlcheck/sig/slope"
SIG_SLOPE_CORR = "rlcheck/sig/slope_corr"
SIG_SHIFT_BASE = "rlcheck/sig/shift_abs_diff"
SIG_SHIFT_GAIN = "rlcheck/sig/shift_gain"
SIG_SHIFT_DIRECTION = "rlcheck/sig/shift_direction"
SIG_EARLY_DIV_COUNT = "rlcheck/sig/early_div_count"
SIG_EARLY_ANY_COUNT = "rlcheck/sig/early_any_count"  # sequences diverging (|d| > tau) in their first tokens
SIG_EARLY_ANY_EXPECTED = "rlcheck/sig/early_any_expected"  # ... expected were the diverged tokens anywhere
SIG_TOKEN_MISMATCH_COUNT = "rlcheck/sig/token_mismatch_count"
SIG_TOKEN_MISMATCH_FRAC = "rlcheck/sig/token_mismatch_frac"
# twins: tokens scored in identical contexts within a step (`rlcheck.core.stats.twins`; batches with the
# engine's token ids and the prompt ids)
SIG_TWIN_GROUPS = "rlcheck/sig/twin_groups"  # groups of identical contexts compared
SIG_TWIN_SPLIT = "rlcheck/sig/twin_split"  # ... the engine scored apart (the trainer alike)
SIG_TWIN_SPLIT_SEQS = "rlcheck/sig/twin_split_seqs"  # sequences in those groups
SIG_TWIN_TRAINER_SPLIT = "rlcheck/sig/twin_trainer_split"  # groups the trainer scored apart
SIG_TWIN_SPREAD = "rlcheck/sig/twin_spread"  # the largest split group's engine spread (nats)
SIG_TWIN_FIRST_POS = "rlcheck/sig/twin_first_pos"  # the earliest response position of a split group
SIG_TWIN_OFF = "rlcheck/sig/twin_off"  # groups both sides scored alike, off from each other together
SIG_TWIN_OFF_SEQS = "rlcheck/sig/twin_off_seqs"  # sequences in those groups
SIG_TWIN_OFF_GAP = "rlcheck/sig/twin_off_gap"  # the largest off group's |mean d| (nats)
SIG_TWIN_ROUTED = "rlcheck/sig/twin_routed"  # 1: an MoE batch (router noise splits twins too)

# beyond the sampled token (StatsConfig.distribution, batches with top-k; rlcheck.core.stats.distribution)
DIST_COUNT = "rlcheck/dist/num_tokens"  # positions scored
DIST_KL_MEAN = "rlcheck/dist/kl_mean"  # KL(engine || trainer) over E's tokens and one tail bucket
DIST_KL_MAX = "rlcheck/dist/kl_max"
DIST_TOPK_OVERLAP_MEAN = "rlcheck/dist/topk_overlap_mean"  # |engine top-K ∩ trainer top-K| / K
DIST_TOP1_AGREE_FRAC = "rlcheck/dist/top1_agree_frac"  # positions where both argmaxes agree
DIST_TAIL_MASS_ROLLOUT_MEAN = "rlcheck/dist/tail_mass_rollout_mean"  # engine's mass outside its top-K
DIST_TAIL_MASS_TRAIN_MEAN = "rlcheck/dist/tail_mass_train_mean"  # trainer's mass outside the engine's top-K
DIST = (DIST_COUNT, DIST_KL_MEAN, DIST_KL_MAX, DIST_TOPK_OVERLAP_MEAN, DIST_TOP1_AGREE_FRAC,
        DIST_TAIL_MASS_ROLLOUT_MEAN, DIST_TAIL_MASS_TRAIN_MEAN)

# mixture-of-experts routing (batches that carry `StepBatch.routing`; rlcheck.core.moe)
MOE_TOKEN_COUNT = "rlcheck/moe/num_tokens"  # tokens whose routing both sides reported
MOE_ROUTE_AGREE_FRAC = "rlcheck/moe/route_agree_frac"  # same top-k expert set at every MoE layer
MOE_ABS_DIFF_SHARE = "rlcheck/moe/abs_diff_share_rerouted"  # share of sum |d| on tokens routed differently
MOE_ABS_DIFF_LIFT = "rlcheck/moe/abs_diff_lift"  # mean |d| rerouted / mean |d| routed alike


def moe_layer_agree(layer: int) -> str:
    """Key of the fraction of tokens routed alike at MoE layer `layer`."""
    return f"rlcheck/moe/layer{layer}_agree_frac"


def moe_first_diff(layer: int) -> str:
    """Key of the count of tokens whose routing first differs at MoE layer `layer`."""
    return f"rlcheck/moe/layer{layer}_first_diff_count"


# multi-turn rollouts (batches that carry `StepBatch.turns`; rlcheck.core.stats.turns, rlcheck.core.turn_checks):
# per turn slot the token statistics, `rlcheck/turn/<slot>/<stat>`; nothing without turns
TURN_PREFIX = "rlcheck/turn/"
TURN_MAX_INDEX = 7  # turns 0..7 get their own slot; every turn is in "last" (its sequence's last) or "later" (>= 1)
TURN_SLOTS = (*(str(t) for t in range(TURN_MAX_INDEX + 1)), "last", "later", "head", "body")
"""Slots: turn t (0..7), the last turn of each sequence, every turn from the second on ("later"), and the
first `TurnConfig.head_tokens` tokens of each turn from the second on ("head": right after an observation)
against the rest of those turns ("body")."""
TURN_STATS = ("tokens", "turns", "abs_diff_mean", "abs_diff_clipped_mean", "abs_diff_max", "diff_mean", "kl_k1",
              "kl_k3", "prob_abs_diff_mean", "catastrophic_frac")
TURN_COUNT = "rlcheck/turn/count"  # model turns in the step
TURN_PER_SEQ_MEAN = "rlcheck/turn/per_seq_mean"
TURN_PER_SEQ_MAX = "rlcheck/turn/per_seq_max"
TURN_TOOL_TOKENS = "rlcheck/turn/tool_tokens"  # tool / observation tokens (not the model's)
TURN_ZERO_LP_COUNT = "rlcheck/turn/zero_lp_count"  # compared tokens, engine logprob exactly 0.0, trainer's <= -1e-3
TURN_WORST = "rlcheck/turn/worst"  # the turn (0..7) of the largest clipped mean |d|
TURN_WORST_LEVEL = "rlcheck/turn/worst_abs_diff_clipped_mean"
TURN_SLOPE = "rlcheck/turn/slope"  # least squares of the turns' clipped mean |d| on the turn (0..7), per turn
TURN_LATER_RATIO = "rlcheck/turn/later_ratio"  # clipped mean |d| of turns >= 1 over turn 0's
TURN_HEAD_BODY_RATIO = "rlcheck/turn/head_body_ratio"  # clipped mean |d| of the turns' heads over their bodies
TURN_INVARIANTS = ("prefix_break", "zero_logprobs", "logprob_count", "turn_count", "stale_turn", "tool_in_loss")
"""The cross-turn invariants (`rlcheck.core.turn_checks`): `rlcheck/turn/inv/<name>_count` sequences break each."""
TURN_MASKED_TOKENS = "rlcheck/turn/inv/masked_tokens"  # tokens of stale turns masked out of the step


def turn_metric(slot: str | int, stat: str) -> str:
    """Key of statistic `stat` (`TURN_STATS`) of turn slot `slot` (`TURN_SLOTS`)."""
    return f"{TURN_PREFIX}{slot}/{stat}"


def turn_invariant(name: str) -> str:
    """Key of the count of sequences that break invariant `name` (`TURN_INVARIANTS`)."""
    return f"{TURN_PREFIX}inv/{name}_count"


TURN_KEYS = (*(turn_metric(slot, stat) for slot in TURN_SLOTS for stat in TURN_STATS),
             TURN_COUNT, TURN_PER_SEQ_MEAN, TURN_PER_SEQ_MAX, TURN_TOOL_TOKENS, TURN_ZERO_LP_COUNT, TURN_WORST,
             TURN_WORST_LEVEL, TURN_SLOPE, TURN_LATER_RATIO, TURN_HEAD_BODY_RATIO,
             *(turn_invariant(name) for name in TURN_INVARIANTS), TURN_MASKED_TOKENS)
"""Every `rlcheck/turn/*` key a multi-turn step may log (a step without turns logs none)."""


# monitor bookkeeping
WEIGHTS_MAX_LAG = "rlcheck/weights/max_lag"  # trainer version - oldest sequence's weight version
WEIGHTS_STALE_COUNT = "rlcheck/weights/stale_count"  # sequences past MonitorConfig.max_weight_lag
# (both logged when the step's batch carried weight versions and observe was given trainer_version)
# quarantine (`rlcheck.core.quarantine`; logged when MonitorConfig.quarantine is set)
QUARANTINE_COUNT = "rlcheck/quarantine/count"  # sequences taken out of the step
QUARANTINE_FRAC = "rlcheck/quarantine/frac"  # ... as a fraction of the step's sequences
QUARANTINE_TOKEN_FRAC = "rlcheck/quarantine/token_frac"  # their tokens, of the step's tokens
QUARANTINE_UNDUMPED = "rlcheck/quarantine/undumped_count"  # quarantined past the run's dump budget
ALARM_COUNT = "rlcheck/alarm/count"
MONITOR_SECONDS = "rlcheck/monitor/seconds"


def quarantine_reason(reason: str) -> str:
    """Key of the count of sequences quarantined for `reason` (`rlcheck.core.quarantine.REASONS`)."""
    return f"rlcheck/quarantine/{reason}_count"


def frac_abs_diff_above(threshold: float) -> str:
    """Key of the fraction of tokens with |d| > `threshold`."""
    return f"rlcheck/token/frac_abs_diff_gt_{threshold:g}"


# Keys the standard statistics produce for every step with at least one valid token (the threshold
# fractions and first-divergence keys are added per configuration / when a sequence diverged). When no
# token is valid (all masked or non-finite) only the counts are logged: an undefined metric is absent,
# never NaN.
ALWAYS = (
    TOKEN_COUNT, TOKEN_MASKED_COUNT, NONFINITE_COUNT, ABS_DIFF_MEAN, ABS_DIFF_CLIPPED_MEAN,
    CATASTROPHIC_TOKEN_FRAC, ABS_DIFF_P50, ABS_DIFF_P90,
    ABS_DIFF_P99, ABS_DIFF_MAX, DIFF_MEAN, KL_K1, KL_K2, KL_K3, CHI2, PROB_ABS_DIFF_MEAN,
    PROB_ABS_DIFF_MAX, MULT_PROB_ERROR, RATIO_MEAN, RATIO_STD, RATIO_MIN, RATIO_MAX, RATIO_ESS,
    RATIO_FRAC_ABOVE_C, RATIO_CLIPPED_COUNT, SEQ_COUNT, SEQ_EMPTY_COUNT, SEQ_MAX_ABS_DIFF_MEAN,
    SEQ_MAX_ABS_DIFF_MAX, SEQ_LOG_RATIO_MEAN, SEQ_LOG_RATIO_ABS_MAX, SEQ_LOG_PPL_DIFF_MEAN,
    SEQ_LOG_PPL_DIFF_ABS_MAX, SEQ_FLAGGED_FRAC, SEQ_CATASTROPHIC_COUNT, SEQ_CATASTROPHIC_FRAC,
    SIG_SLOPE, SIG_SLOPE_CORR, SIG_SHIFT_BASE, SIG_SHIFT_GAIN, SIG_SHIFT_DIRECTION, SIG_EARLY_DIV_COUNT,
    SIG_EARLY_ANY_COUNT, SIG_EARLY_ANY_EXPECTED,
)


# ---- the names a rule may watch -------------------------------------------------------------------
# Every constant above that starts with PREFIX is a known name; a key built by a function (a family:
# its prefix, the pattern of the rest, an example) registers here, in FAMILIES. A threshold rule, a
# hard limit or a detector watching a name that is neither is refused when the MonitorConfig is built
# (`check_names`), with the closest known name: a typo would otherwise never fire, silently.

CORR_PREFIX = "rlcheck/corr/"  # the correction's metrics, verl's names (`rlcheck.core.correction`)
CORR_IS_STATS = ("mean", "max", "min", "std", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low",
                 "seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                 "seq_fraction_low", "oob_ratio", "batch_norm_factor")
CORR_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                   "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
CORR_RS_STATS = ("mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max",
                 "seq_min", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low", "masked_fraction",
                 "seq_masked_fraction")


def corr_names() -> tuple[str, ...]:
    """Every `rlcheck/corr/*` key the correction can log (`MonitorConfig.correction`)."""
    names = [f"{CORR_PREFIX}rollout_is_{s}" for s in CORR_IS_STATS]
    names += [f"{CORR_PREFIX}rollout_rs_{s}" for s in ("masked_fraction", "seq_masked_fraction")]
    return (*names, *(f"{CORR_PREFIX}rollout_rs_{o}_{s}" for o in CORR_RS_OPTIONS for s in CORR_RS_STATS))


FAMILIES = (
    ("rlcheck/token/frac_abs_diff_gt_", r"[0-9.e+-]+", frac_abs_diff_above(0.5)),
    ("rlcheck/moe/layer", r"[0-9]+_(agree_frac|first_diff_count)", moe_layer_agree(0)),
    ("rlcheck/quarantine/", r"[a-z_]+_count", quarantine_reason("early")),
)
"""(prefix, regular expression of the rest, an example) of each family of keys made by a function."""


def known_names() -> tuple[str, ...]:
    """Every fixed key: the constants of this module under PREFIX, the multi-turn ones and the correction's."""
    fixed = [v for k, v in globals().items() if k.isupper() and isinstance(v, str) and v.startswith(PREFIX)
             and not v.endswith("/")]
    return (*dict.fromkeys([*fixed, *TURN_KEYS]), *corr_names())


def is_known(name: str) -> bool:
    """True for a fixed key or one of a family's."""
    return name in known_names() or any(name.startswith(p) and re.fullmatch(rest, name[len(p):])
                                        for p, rest, _ in FAMILIES)


def closest(name: str) -> str | None:
    """The known key (a family's example included) nearest to `name`, None when none is near."""
    found = difflib.get_close_matches(name, [*known_names(), *(ex for _, _, ex in FAMILIES)], n=1, cutoff=0.6)
    return found[0] if found else None


def check_names(watched: list[tuple[str, str]]) -> None:
    """Raise ValueError naming the first (where, name) of `watched` that no metric has, with the
    closest known one (the caller turns it into its ConfigError)."""
    for where, name in watched:
        if not isinstance(name, str) or not is_known(name):
            near = closest(name) if isinstance(name, str) else None
            hint = f"; did you mean {near!r}?" if near else f"; metric names start with {PREFIX!r}"
            outside = ("" if not isinstance(name, str) or name.startswith(PREFIX) else
                       " (your own scalars, observe's `extra`, reach the hard limits only, not the detectors)")
            raise ValueError(f"{where} watches {name!r}, which no rlcheck metric is{outside}{hint}")
