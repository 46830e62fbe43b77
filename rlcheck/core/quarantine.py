"""Quarantine: take the few sequences the evidence condemns out of the step, instead of halting the run.

    report = Monitor(MonitorConfig(run_dir, quarantine=QuarantineConfig())).observe(step, batch)
    report.keep            # (N,) bool, batch order: False for a quarantined sequence
    report.quarantined     # (Quarantined(request_id, index, reason, ...), ...)

A sequence is condemned by the first rule of `QuarantineConfig.rules` it breaks (in `REASONS`
order; `Quarantined.reasons` lists all it breaks):

| reason            | the sequence ...                                                                   |
|-------------------|------------------------------------------------------------------------------------|
| nonfinite         | holds a NaN/inf logprob (or a -1e9-style sentinel) on a compared token             |
| catastrophic      | has `StatsConfig.catastrophic_min_frac` of its tokens (and at least                |
|                   | `catastrophic_min_tokens`) at |d| >= `catastrophic_tau`; or a corrupted tail       |
|                   | (`QuarantineConfig.tail_span`, `corrupt_tails`: a rate of a long response misses it) |
| early_divergence  | diverges within its first `early_window` tokens, with `catastrophic_min_tokens`    |
|                   | tokens past `divergence_tau` and one past `catastrophic_tau` in its first          |
|                   | `early_span`; or diverges in its first tokens on a step with the signature         |
|                   | detector's early burst (`SignatureConfig.early_*`: a stale state, step-wide)       |
| token_mismatch    | was scored by the trainer on other token ids than the engine sampled               |
| stale_weights     | comes from weights further behind the trainer's than `MonitorConfig.max_weight_lag`|
| turn_invariant    | breaks a cross-turn invariant of its multi-turn batch (`rlcheck.core.turn_checks`)  |
| prompt_mismatch,  | is named (`details["request_ids"]`) by an alarm found outside the Monitor: a       |
| decode_prefill,   | prompt-id alarm, the decode-prefill audit's, the engine guard's, another's; each   |
| guard, alarm      | reason says what raised it (`outside_reason`; a `weights` one: stale_weights)      |

These are the statistics' and the detectors' own rules (`rlcheck.core.stats.sequences`) but one: a corrupted
tail (`corrupt_tails`) is the quarantine's alone, not counted catastrophic in the statistics or their limits.

With some sequences quarantined, the detectors, the hard limits and the weight-version check judge the kept
sequences (what the trainer learns from); the offenders are the kept ones' worst, their `index` in the whole
batch. Past `max_frac` of the step's sequences the step is judged whole, as if quarantine were off (so the
alarms that name the cause fire), and a critical `quarantine` alarm halts the run: masking that much would
hide a broken engine (a step past it only through a burst of early divergences halts, as the signature
detector does, when the burst recurs within its `recur_window`; once, it warns). With `patience` set,
quarantine on that many steps in a row halts too. The run's bookkeeping, the alarm and the dumps:
`rlcheck.core.quarantine_run`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import response_mask
from rlcheck.core.detect.signature import SignatureConfig, early_burst
from rlcheck.core.stats import PartialStats, StatsConfig, compute_partial, empty_partial
from rlcheck.core.stats.sequences import catastrophic_parts, first_positions, segment_count, segment_max
from rlcheck.core.types import Alarm
from rlcheck.core.weights import is_stale
from rlcheck.errors import ConfigError

REASONS = ("nonfinite", "catastrophic", "early_divergence", "token_mismatch", "stale_weights", "turn_invariant",
           "prompt_mismatch", "decode_prefill", "guard", "alarm")
OUTSIDE_REASONS = {"prompt_id_mismatch": "prompt_mismatch", "decode_prefill": "decode_prefill", "engine_guard": "guard"}
"""An outside alarm's `details["signature"]` -> the reason its sequences are quarantined for (the
signatures of `rlcheck.core.prompt_ids`, `rlcheck.loop.audit` and `rlcheck.engines.guard`)."""

MAX_LISTED = 100
"""Quarantined sequences a step's metrics.jsonl record lists (all of them are in `StepReport`)."""


@dataclass(frozen=True)
class QuarantineConfig:
    """When a sequence is quarantined rather than the run halted (docs/quarantine.md)."""

    rules: tuple[str, ...] = REASONS
    """The reasons (`REASONS`) that quarantine a sequence."""
    max_frac: float = 0.1
    """A step quarantining more than this fraction of its sequences halts (a critical `quarantine`
    alarm), judged whole. The real loop's `corrupt-seqs=0.02` quarantines 1 of 32 (3.1%) a step,
    its `stale-state` 12-100% (BENCHMARKS.md, "Quarantine")."""
    patience: int | None = None
    """Quarantine on this many consecutive observed steps halts; None: never for that alone (a
    steady trickle of bad sequences is what quarantine is for)."""
    dump: bool = True
    """Write each step's quarantined sequences to `RUN_DIR/quarantine/step_N/` (a dump like
    `dumps/step_N/`: replay and localize read it)."""
    max_dumped: int = 1000
    """Sequences written to quarantine dumps over the whole run; past it, the record still lists
    them (request id, reason, max |d|) and `quarantine/undumped_count` counts them."""
    tail_span: int | None = 16
    """A sequence whose last `tail_span` tokens look corrupted is catastrophic (`corrupt_tails`);
    None: off. Measured (BENCHMARKS.md, "Detector power on new shapes"): last 8-15 tokens scored
    d ~ N(0, 2) nats are quarantined 99.0-99.5% of the time, where the rate rule took ~1%; most of
    the rest show one token past 0.5 nats on an uncertain token, as ~0.3% of healthy sequences do."""
    tail_confident_p: float = 0.9
    """A token the engine gave at least this probability is near-certain: healthy bf16 noise scales
    as (1 - p)^0.9 and barely moves it (`benchmarks/data/field_fit.json`: |d| p99 0.09 at p > 0.9)."""

    def __post_init__(self) -> None:
        if isinstance(self.rules, str):
            raise ConfigError(f"quarantine rules is a tuple of reasons, e.g. ({self.rules!r},)")
        unknown = set(self.rules) - set(REASONS)
        if unknown or not self.rules:
            raise ConfigError(f"quarantine rules must be a non-empty subset of {REASONS}, got {self.rules}")
        if not (0 <= self.max_frac < 1):
            raise ConfigError(f"quarantine max_frac must be in [0, 1), got {self.max_frac}")
        if self.patience is not None and (isinstance(self.patience, bool) or int(self.patience) < 1):
            raise ConfigError(f"quarantine patience must be None or >= 1, got {self.patience}")
        if self.max_dumped < 0:
            raise ConfigError(f"quarantine max_dumped must be >= 0, got {self.max_dumped}")
        if (self.tail_span is not None and self.tail_span < 2) or not 0 < self.tail_confident_p < 1:
            raise ConfigError("quarantine tail_span must be None or >= 2 and tail_confident_p in (0, 1)")


@dataclass(frozen=True)
class Quarantined:
    """One sequence taken out of a step."""

    request_id: str
    index: int  # its position in the observed batch
    reason: str  # the first of REASONS it breaks
    reasons: tuple[str, ...]
    max_abs_diff: float
    first_divergence: int | None
    length: int

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "index": self.index, "reason": self.reason,
                "reasons": list(self.reasons), "max_abs_diff": self.max_abs_diff,
                "first_divergence": self.first_divergence, "length": self.length}


@dataclass(frozen=True)
class Verdict:
    """What the rules say of one batch: which sequences to keep, and why the others go."""

    keep: np.ndarray  # (N,) bool
    quarantined: tuple[Quarantined, ...]
    num_tokens: int  # tokens of the quarantined sequences
    total_tokens: int
    burst_only: int = 0
    """Sequences condemned by the step's burst of early divergences alone (no rule of their own)."""

    @property
    def count(self) -> int:
        return len(self.quarantined)

    @property
    def frac(self) -> float:
        return self.count / max(self.keep.shape[0], 1)

    def reason_counts(self) -> dict[str, int]:
        """Quarantined sequences per (first) reason, every reason of REASONS."""
        return {r: sum(q.reason == r for q in self.quarantined) for r in REASONS}

    def metrics(self) -> dict[str, float]:
        out = {K.QUARANTINE_COUNT: float(self.count), K.QUARANTINE_FRAC: self.frac,
               K.QUARANTINE_TOKEN_FRAC: self.num_tokens / max(self.total_tokens, 1)}
        out.update({K.quarantine_reason(r): float(n) for r, n in self.reason_counts().items()})
        return out


def outside_reason(alarm: Alarm) -> str:
    """The reason an alarm found outside the Monitor quarantines the sequences it names: "stale_weights"
    for a `weights` alarm, else by its signature (`OUTSIDE_REASONS`), "alarm" for any other."""
    if alarm.kind == "weights":
        return "stale_weights"
    return OUTSIDE_REASONS.get(alarm.details.get("signature"), "alarm")


def burst_counts(flags: Mapping[str, np.ndarray]) -> np.ndarray:
    """(5,) float64 counts the step's early burst is decided on, additive over a step's parts (ranks):
    sequences diverging early, sequences, diverged tokens, compared tokens, early slots."""
    return np.array([np.count_nonzero(flags["early_any"]), flags["early_any"].shape[0], flags["diverged_tokens"],
                     flags["valid_tokens"], flags["early_slots"]], dtype=np.float64)


def is_burst(counts: np.ndarray, signature: SignatureConfig | None = None) -> bool:
    """Whether `burst_counts` (of one batch, or summed over a step's ranks) make a burst of early
    divergences at the signature detector's levels (default `SignatureConfig()`)."""
    early, num, diverged, valid, slots = (float(c) for c in counts)
    return early_burst(early, num, diverged / max(valid, 1.0) * slots, signature or SignatureConfig())


def judge(batch: StepBatch, stats: StatsConfig, cfg: QuarantineConfig, *, trainer_version: int | None = None,
          max_weight_lag: int = 0, alarms: Sequence[Alarm] = (), signature: SignatureConfig | None = None,
          flags: Mapping[str, np.ndarray] | None = None, burst: bool | None = None, turn_invariant=None) -> Verdict:
    """The rules of `cfg` applied to every sequence of `batch` (vectorised over tokens); `signature`:
    the signature detector's early-burst levels (default `SignatureConfig()`); `turn_invariant`: (N,) bool, the
    Monitor's multi-turn verdict (`rlcheck.core.turn_checks`). A step split over ranks passes its
    `per_sequence_flags` and whether it is a burst (`is_burst` of the summed `burst_counts`), as one process."""
    cu = batch.cu_seqlens  # (N+1,)
    num = batch.num_sequences
    flags = per_sequence_flags(batch, stats) if flags is None else flags
    burst = is_burst(burst_counts(flags), signature) if burst is None else burst
    by_burst = np.zeros(num, dtype=bool)  # early divergences condemned by the step's burst alone
    if "early_divergence" in cfg.rules and burst:
        by_burst = flags["early_any"] & ~flags["early"]
    catastrophic = flags["catastrophic"]
    if cfg.tail_span is not None:
        catastrophic = catastrophic | corrupt_tails(batch, stats, cfg.tail_span, cfg.tail_confident_p)
    found: dict[str, np.ndarray] = {
        "nonfinite": flags["nonfinite"], "catastrophic": catastrophic,
        "early_divergence": flags["early"], "token_mismatch": flags["token_mismatch"],
    }
    stale = np.zeros(num, dtype=bool)
    if trainer_version is not None and batch.weight_version is not None:
        stale = is_stale(batch.weight_version, trainer_version, max_weight_lag)  # (N,)
    found["stale_weights"], found["turn_invariant"] = stale, np.zeros(num, bool) if turn_invariant is None else turn_invariant
    for reason in ("prompt_mismatch", "decode_prefill", "guard", "alarm"):
        found[reason] = np.zeros(num, dtype=bool)
    for a in alarms:
        named = set(a.details.get("request_ids") or ())
        if named:
            found[outside_reason(a)] |= np.array([rid in named for rid in batch.request_ids], dtype=bool)
    firm = np.zeros(num, dtype=bool)  # what the per-sequence rules condemn
    for reason in cfg.rules:
        firm |= found[reason]
    found["early_divergence"] = found["early_divergence"] | by_burst
    condemned = firm | by_burst
    lens = np.diff(cu)
    out = []
    for i in np.flatnonzero(condemned).tolist():
        reasons = tuple(r for r in REASONS if r in cfg.rules and found[r][i])
        first = int(flags["first_div"][i])
        out.append(Quarantined(batch.request_ids[i], i, reasons[0], reasons, float(flags["max_abs_diff"][i]),
                               first if first >= 0 else None, int(lens[i])))
    return Verdict(~condemned, tuple(out), int(lens[condemned].sum()), batch.num_tokens,
                   int(np.count_nonzero(by_burst & ~firm)))


def tail_window(batch: StepBatch, span: int, confident_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(N, span) each sequence's last `span` tokens, newest first: |d| (0 past the sequence's start and
    on tokens not compared), and whether the engine gave the token at least `confident_p`."""
    cu = batch.cu_seqlens  # (N+1,)
    lr = batch.logp_rollout.astype(np.float64)
    valid = response_mask(batch)  # (M,)
    with np.errstate(invalid="ignore"):
        ad = np.where(valid, np.abs(batch.logp_train.astype(np.float64) - lr), 0.0)  # (M,)
    idx = cu[1:, None] - 1 - np.arange(span)[None, :]  # (N, span)
    inside = idx >= cu[:-1, None]
    idx = np.where(inside, idx, 0)
    tail = np.where(inside, ad[idx] if ad.size else 0.0, 0.0)
    confident = inside & (lr[idx] >= np.log(confident_p)) if lr.size else inside
    return tail, confident


def corrupt_tails(batch: StepBatch, stats: StatsConfig, span: int, confident_p: float) -> np.ndarray:
    """(N,) bool: sequences whose last `span` tokens hold two past `divergence_tau`, and
    besides either a near-certain token (engine probability >= `confident_p`) past divergence_tau / 2
    or two tokens past 2 * divergence_tau; or a near-certain token past 2 * divergence_tau alone
    (healthy noise there is under 0.1 nats at p99: 1 nat is a token the trainer finds 2.7x less
    likely than a sure one). A healthy tail token is one token, on an uncertain one; a corrupted span
    of 8-15 tokens shows several, and breaks near-certain ones. The rate rule (`catastrophic_min_frac`)
    misses such a span at the end of a long response: 15 tokens of 900. What it cannot see: a span
    whose one visible token sits on an uncertain one, shaped like a healthy tail token (BENCHMARKS.md,
    "Detector power on new shapes": recall and the healthy sequences of that shape)."""
    tail, confident = tail_window(batch, span, confident_p)
    tau = stats.divergence_tau
    diverged = np.count_nonzero(tail > tau, axis=1)
    backed = (np.count_nonzero(confident & (tail > tau / 2), axis=1) > 0) | (np.count_nonzero(tail > 2 * tau, axis=1) >= 2)
    sure_broken = np.count_nonzero(confident & (tail > 2 * tau), axis=1) > 0
    return ((diverged >= 2) & backed) | sure_broken


def per_sequence_flags(batch: StepBatch, stats: StatsConfig) -> dict[str, np.ndarray]:
    """(N,) arrays of the statistics' per-sequence rules: nonfinite, catastrophic (the rate clause),
    early (the early clause), token_mismatch (bool), early_any (diverged within the early window);
    max_abs_diff (float64); first_div (int64, -1 where none): the same numbers `compute_partial`
    counts; and the scalars the early burst is decided on (`burst_counts`)."""
    cu = batch.cu_seqlens
    num = batch.num_sequences
    lr, lt = batch.logp_rollout, batch.logp_train
    if lr.dtype != lt.dtype:
        lr, lt = lr.astype(np.float64), lt.astype(np.float64)
    compared = np.ones(lr.shape[0], dtype=bool) if batch.mask is None else batch.mask
    valid = response_mask(batch)  # (M,) compared and finite on both sides
    bad = compared & ~valid  # NaN, -inf, sentinels
    with np.errstate(invalid="ignore"):
        ad = np.where(valid, np.abs(lt - lr), 0.0)  # (M,)
    counts = segment_count(valid, cu)
    rate, early = catastrophic_parts(ad, cu, counts, stats)
    nonfinite = segment_count(bad, cu) > 0
    mismatch = np.zeros(num, dtype=bool)
    if batch.tokens is not None and batch.tokens_train is not None:
        mismatch = segment_count((batch.tokens != batch.tokens_train) & compared, cu) > 0
    first_div = np.full(num, -1, dtype=np.int64)
    diverged = ad > stats.divergence_tau
    seqs, pos = first_positions(diverged | bad, cu)
    first_div[seqs] = pos
    # what the signature detector's early burst reads (`sig/early_any_count`, `sig/early_any_expected`)
    early_slots = float(np.minimum(counts, stats.early_window).sum())
    return {"nonfinite": nonfinite, "catastrophic": rate, "early": early, "token_mismatch": mismatch,
            "max_abs_diff": segment_max(ad, cu), "first_div": first_div,
            "early_any": (first_div >= 0) & (first_div < stats.early_window),
            "diverged_tokens": np.float64(np.count_nonzero(diverged)), "valid_tokens": np.float64(counts.sum()),
            "early_slots": np.float64(early_slots)}


def kept_partial(batch: StepBatch, verdict: Verdict, stats: StatsConfig) -> PartialStats:
    """The statistics of the sequences `verdict` keeps, their offenders' `index` counted in `batch`
    (and `num_sequences` that of `batch`, so ranks' offsets stay right)."""
    kept = np.flatnonzero(verdict.keep)
    if kept.size == 0:
        part = empty_partial(stats, 0)
    else:
        part = compute_partial(batch.select(kept), stats)
    offenders = tuple(replace(o, index=int(kept[o.index])) for o in part.offenders)
    return replace(part, offenders=offenders, num_sequences=batch.num_sequences)


def step_partial(batch: StepBatch, stats: StatsConfig, cfg: QuarantineConfig | None, trainer_version: int | None,
                 max_weight_lag: int, alarms: Sequence[Alarm], signature: SignatureConfig | None = None,
                 turn_invariant: np.ndarray | None = None) -> tuple[PartialStats, Verdict | None]:
    """The statistics the Monitor judges a step by, and the verdict (None with quarantine off): the
    kept sequences' when some are quarantined within `max_frac`, else the whole batch's."""
    if cfg is None:
        return compute_partial(batch, stats), None
    verdict = judge(batch, stats, cfg, trainer_version=trainer_version, max_weight_lag=max_weight_lag, alarms=alarms,
                    signature=signature, turn_invariant=turn_invariant)
    if 0 < verdict.count and verdict.frac <= cfg.max_frac:
        return kept_partial(batch, verdict, stats), verdict
    return compute_partial(batch, stats), verdict
