"""Signature detector: per-step token-level shapes that name a cause (design.md, failure shapes).

It reads the `sig/` and `seq/` statistics that `rlcheck.core.stats` computes from the tokens:

| signature            | shape                                                              | default   |
|----------------------|--------------------------------------------------------------------|-----------|
| token_id_mismatch    | the trainer scored other token ids than the engine sampled         | critical  |
| shift_by_one         | logp_train[t] fits logp_rollout[t +- 1] far better than [t]        | critical  |
| systematic_slope     | d correlates with logp_rollout (temperature / logit processing)    | warn      |
| early_divergence     | a few sequences diverge from their first tokens (stale state)      | warn      |
| sparse_catastrophic  | a few sequences far off, the rest clean (state corruption, index)  | warn      |
| many_catastrophic    | more than `sparse_max_frac` of them far off, not from the start    | warn      |
| split_twins          | the engine scored identical contexts of the step apart (stale or   | critical  |
|                      | aliased recurrent state: its output is not a function of the request; |        |
|                      | warn on an MoE batch, whose router noise does it too)               |           |
| twins_off            | a few groups of identical contexts, each scored alike by both sides, | critical  |
|                      | off from the trainer together while the step's other groups match,  |           |
|                      | on a dense model with recurrent state (a stale state read alike by   |           |
|                      | every sample of a prompt); not raised on other models, MoEs included |           |

A warn signature that persists is a broken system, not bad luck, and turns critical (it halts): the
slope on `slope_critical_after` consecutive observations (a temperature or processing mismatch is
there every step), catastrophic sequences (either shape) `recur_count` times within the last
`recur_window` observations (a healthy bf16 run has none: a catastrophic sequence is a rate of
tokens far off, `StatsConfig.catastrophic_min_frac`, which no tail token reaches alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.detect.base import SEVERITIES, Alarm, Detector
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class SignatureConfig:
    shift_min_gain: float = 3.0
    """Shifted alignment must fit this many times better than the straight one."""
    shift_min_abs_diff: float = 0.05
    """...and the straight |d| must be above this (not noise)."""
    slope_min_corr: float = 0.5
    slope_min_abs: float = 0.01
    """|slope| of d on logp_rollout; a trainer temperature 1% off the engine's gives ~0.01."""
    slope_min_abs_diff: float = 0.005
    """A slope counts only when mean |d| is above this noise floor (set at the bf16 floor; it scales
    with the run's, `Detector.scale`)."""
    sparse_max_frac: float = 0.1
    """Catastrophic sequences are 'sparse' when at most this fraction of the step; past it they are
    `many_catastrophic` (which counts toward the recurrence as the sparse shape does; a quarter of them
    is also a hard limit, `HaltConfig.hard_limits`)."""
    min_tokens: int = 64
    """Steps with fewer valid tokens give no slope or shift signature."""
    slope_critical_after: int = 4
    """Consecutive observations with the slope signature after which it is critical."""
    recur_count: int = 2
    """Observations with catastrophic sequences, within `recur_window`, that make the signature critical."""
    recur_window: int = 256
    early_min_count: int = 4
    early_min_frac: float = 0.1
    early_excess: float = 3.0
    """Early divergence without catastrophic sequences: at least early_min_count sequences, and
    early_min_frac of the step's, diverge (|d| > divergence_tau) within their first early_window
    tokens, early_excess times more than the step's diverged tokens would put there by chance. The
    engine's stale-state fault on the tiny hybrid: 40% of the sequences diverge at their first token
    by 1.4-3.7 nats, one token past 2 of 32; a healthy or noisy step's divergences fall anywhere."""
    twin_min_split: int = 2
    twin_min_frac: float = 0.05
    """split_twins: at least twin_min_split twin groups, and twin_min_frac of the step's, scored apart by
    the engine (`rlcheck.core.stats.twins`; a healthy engine, fp32 or bf16, scores twins alike to the
    bit; the tiny hybrid's stale state split 3 of 28 to 26 of 33 groups a step)."""
    twin_off_max_frac: float = 0.25
    """twins_off: at least twin_min_split groups and twin_min_frac of the step's off together
    (`rlcheck.core.stats.twins`), and at most this share of them: a fault that moves every request (a
    weight, a temperature, the precision) puts most groups off; a stale state read by some prompts'
    samples, a few (the demo's trained hybrid at bf16: 2 to 3 of 29 to 34 groups a step)."""
    severity: dict[str, str] | None = None
    """Override the default severity of a signature by name."""

    def __post_init__(self) -> None:
        for name, sev in (self.severity or {}).items():
            if name not in DEFAULT_SEVERITY:
                raise ConfigError(f"unknown signature {name!r}; known: {sorted(DEFAULT_SEVERITY)}")
            if sev not in SEVERITIES:
                raise ConfigError(f"severity must be one of {SEVERITIES}, got {sev!r}")
        if not 0 < self.sparse_max_frac <= 1:
            raise ConfigError("sparse_max_frac must be in (0, 1]")
        if not 0 < self.twin_off_max_frac <= 1:
            raise ConfigError("twin_off_max_frac must be in (0, 1]")
        if min(self.slope_critical_after, self.recur_count, self.recur_window) < 1:
            raise ConfigError("slope_critical_after, recur_count and recur_window must be >= 1")


DEFAULT_SEVERITY = {
    "token_id_mismatch": "critical",
    "shift_by_one": "critical",
    "systematic_slope": "warn",
    "early_divergence": "warn",
    "sparse_catastrophic": "warn",
    "many_catastrophic": "warn",
    "split_twins": "critical",
    "twins_off": "critical",
}


class SignatureDetector(Detector):
    kind = "signature"
    state_model: bool | None = None
    """Whether the run's model carries recurrent state and routes no experts
    (`rlcheck.core.model_types.dense_state_model` of the Monitor's context; None: unknown), set by the
    Monitor: `twins_off` is raised only where it is True (a group off together is a stale state's shape
    there; an MoE's router noise moves whole contexts too, and other models were not calibrated)."""

    def __init__(self, cfg: SignatureConfig | None = None):
        self.cfg = cfg or SignatureConfig()
        self.severity = {**DEFAULT_SEVERITY, **(self.cfg.severity or {})}
        self.slope_streak = 0
        self.observed = 0  # observations seen
        self.catastrophic_at: list[int] = []  # observation numbers with catastrophic sequences, recent

    def _alarm(self, name: str, metric: str, step: int, message: str, persistent: bool = False,
               **details: Any) -> Alarm:
        severity = "critical" if persistent else self.severity[name]
        return Alarm(self.kind, metric, step, severity, message, {"signature": name, **details})

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        cfg, m, out = self.cfg, metrics, []
        get = m.get
        if get(K.SIG_TOKEN_MISMATCH_COUNT, 0.0) > 0:
            out.append(self._alarm(
                "token_id_mismatch", K.SIG_TOKEN_MISMATCH_COUNT, step,
                f"{int(m[K.SIG_TOKEN_MISMATCH_COUNT])} tokens scored by the trainer are not the tokens the "
                "engine sampled (tokenizer drift or chat-template mismatch)",
                count=m[K.SIG_TOKEN_MISMATCH_COUNT], frac=m[K.SIG_TOKEN_MISMATCH_FRAC],
            ))
        enough = get(K.TOKEN_COUNT, 0.0) >= cfg.min_tokens
        if enough and get(K.SIG_SHIFT_GAIN, 0.0) >= cfg.shift_min_gain and get(K.SIG_SHIFT_BASE, 0.0) >= cfg.shift_min_abs_diff:
            direction = int(m[K.SIG_SHIFT_DIRECTION])
            fit = "logp_rollout[t+1]" if direction > 0 else "logp_rollout[t-1]"
            out.append(self._alarm(
                "shift_by_one", K.SIG_SHIFT_GAIN, step,
                f"logp_train[t] matches {fit} {m[K.SIG_SHIFT_GAIN]:.1f}x better than logp_rollout[t]: "
                "the two sides are misaligned by one token",
                gain=m[K.SIG_SHIFT_GAIN], direction=direction,
            ))
        corr, slope = get(K.SIG_SLOPE_CORR, 0.0), get(K.SIG_SLOPE, 0.0)
        sloped = (enough and abs(corr) >= cfg.slope_min_corr and abs(slope) >= cfg.slope_min_abs
                  and get(K.ABS_DIFF_MEAN, 0.0) >= cfg.slope_min_abs_diff * self.scale)
        self.slope_streak = self.slope_streak + 1 if sloped else 0
        if sloped:
            lasting = self.slope_streak >= cfg.slope_critical_after
            out.append(self._alarm(
                "systematic_slope", K.SIG_SLOPE, step,
                f"d = logp_train - logp_rollout follows logp_rollout (slope {slope:.3f}, corr {corr:.2f}"
                f"{f', {self.slope_streak} observations running' if lasting else ''}): "
                "temperature or logit processing differs between engine and trainer",
                persistent=lasting, slope=slope, corr=corr, streak=self.slope_streak,
            ))
        out += self._split_twins(step, m)
        out += self._twins_off(step, m)
        self.observed += 1
        out += self._catastrophic(step, m)
        return out

    def _split_twins(self, step: int, m: dict[str, float]) -> list[Alarm]:
        split, groups = m.get(K.SIG_TWIN_SPLIT, 0.0), m.get(K.SIG_TWIN_GROUPS, 0.0)
        if split < max(self.cfg.twin_min_split, self.cfg.twin_min_frac * groups):
            return []
        where = f", the first at response position {int(m[K.SIG_TWIN_FIRST_POS])}" if K.SIG_TWIN_FIRST_POS in m else ""
        routed = bool(m.get(K.SIG_TWIN_ROUTED))
        alarm = self._alarm(
            "split_twins", K.SIG_TWIN_SPLIT, step,
            f"the engine scored {int(split)} of {int(groups)} groups of identical contexts (the same prompt and "
            f"response prefix; {int(m.get(K.SIG_TWIN_SPLIT_SEQS, 0))} sequences{where}) up to "
            f"{m.get(K.SIG_TWIN_SPREAD, 0.0):.3g} nats apart while the trainer scored each alike: its output depends "
            "on more than the request's tokens, a recurrent state read from another request (stale state: a reused "
            "Mamba slot) or shared with one (index aliasing)"
            + ("; on an MoE, router noise (near-tie tokens sent to other experts) does it too: see moe/*" if routed else ""),
            split=split, groups=groups, sequences=m.get(K.SIG_TWIN_SPLIT_SEQS, 0.0),
            spread=m.get(K.SIG_TWIN_SPREAD, 0.0), first_position=m.get(K.SIG_TWIN_FIRST_POS), routed=routed,
        )
        if routed and "split_twins" not in (self.cfg.severity or {}):  # an MoE's router noise is no halt by itself
            alarm = Alarm(alarm.kind, alarm.metric, alarm.step, "warn", alarm.message, alarm.details)
        return [alarm]

    def _twins_off(self, step: int, m: dict[str, float]) -> list[Alarm]:
        off, groups = m.get(K.SIG_TWIN_OFF, 0.0), m.get(K.SIG_TWIN_GROUPS, 0.0)
        cfg = self.cfg
        if self.state_model is not True or m.get(K.SIG_TWIN_ROUTED) or off > cfg.twin_off_max_frac * groups:
            return []
        if off < max(cfg.twin_min_split, cfg.twin_min_frac * groups):
            return []
        return [self._alarm(
            "twins_off", K.SIG_TWIN_OFF, step,
            f"{int(off)} of {int(groups)} groups of identical contexts ({int(m.get(K.SIG_TWIN_OFF_SEQS, 0))} sequences) "
            f"are each scored alike by both sides yet off from the trainer together, by up to "
            f"{m.get(K.SIG_TWIN_OFF_GAP, 0.0):.3g} nats, while the step's other groups match: on a model with recurrent "
            "state, the engine computed those prompts' samples from a state not their own (stale state: a reused "
            "Mamba slot read before its prefill)",
            groups_off=off, groups=groups, sequences=m.get(K.SIG_TWIN_OFF_SEQS, 0.0), gap=m.get(K.SIG_TWIN_OFF_GAP, 0.0),
        )]

    def _early_burst(self, m: dict[str, float]) -> bool:
        return early_burst(m.get(K.SIG_EARLY_ANY_COUNT, 0.0), m.get(K.SEQ_COUNT, 0.0),
                           m.get(K.SIG_EARLY_ANY_EXPECTED, 0.0), self.cfg)

    def _catastrophic(self, step: int, m: dict[str, float]) -> list[Alarm]:
        count = m.get(K.SEQ_CATASTROPHIC_COUNT, 0.0)
        burst = self._early_burst(m)
        if count <= 0 and not burst:
            return []
        sparse = m.get(K.SEQ_CATASTROPHIC_FRAC, 1.0) <= self.cfg.sparse_max_frac
        if not (sparse or burst or count >= 2):
            return []  # one sequence of a small batch is no "many" (a NaN one has its own alarm)
        early = m.get(K.SIG_EARLY_DIV_COUNT, 0.0)
        if burst and early * 2 < count:
            burst = False  # catastrophic sequences that are not early: the sparse shape below
        if burst:
            count = early = max(early, m.get(K.SIG_EARLY_ANY_COUNT, 0.0))
        recent = [o for o in self.catastrophic_at if o > self.observed - self.cfg.recur_window] + [self.observed]
        self.catastrophic_at = recent
        lasting = len(recent) >= self.cfg.recur_count
        again = f" (in {len(recent)} of the last {self.cfg.recur_window} observations)" if lasting else ""
        details = {"count": count, "early": early, "frac": m.get(K.SEQ_CATASTROPHIC_FRAC, 0.0), "recurrences": len(recent)}
        if early * 2 >= count and (sparse or burst):
            name, metric = "early_divergence", K.SIG_EARLY_DIV_COUNT
            message = (f"{int(early)} of {int(count)} far-off sequences diverge from their first tokens while the "
                       f"rest match{again}: the shape of a stale recurrent state (a reused Mamba slot read before prefill)")
        elif not sparse:
            name, metric = "many_catastrophic", K.SEQ_CATASTROPHIC_COUNT
            message = (f"{int(count)} sequences ({details['frac']:.0%} of the step) are far off, not from their first "
                       f"tokens{again}: too many for one bad request (state shared between requests, index aliasing, "
                       "a broken kernel); see the offenders")
        else:
            name, metric = "sparse_catastrophic", K.SEQ_CATASTROPHIC_COUNT
            message = (f"{int(count)} sequences are far off (a twentieth of their tokens or more at or above the "
                       f"catastrophic level) while the rest match{again}: a per-request fault (state corruption, index "
                       "aliasing); see the offenders")
        return [self._alarm(name, metric, step, message, persistent=lasting, **details)]

    def state_dict(self) -> dict[str, Any]:
        return {"slope_streak": self.slope_streak, "observed": self.observed, "catastrophic_at": self.catastrophic_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.slope_streak = int(state.get("slope_streak", 0))
        self.observed = int(state.get("observed", 0))
        self.catastrophic_at = [int(o) for o in state.get("catastrophic_at", ())]


def early_burst(early: float, num_sequences: float, expected: float, cfg: SignatureConfig) -> bool:
    """A step's burst of early divergences: `early` sequences diverging in their first tokens, at least
    `early_min_count` and `early_min_frac` of the step's `num_sequences`, and `early_excess` times the
    `expected` count were its diverged tokens anywhere (the quarantine reads the same test)."""
    return early >= max(cfg.early_min_count, cfg.early_min_frac * num_sequences) and early >= cfg.early_excess * expected
