"""The statistics' configuration and data types: StatsConfig, PartialStats and merge (`Offender` lives
in `rlcheck.core.types`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rlcheck.core.limits import MIN_LOGPROB, RATIO_LOG_CAP  # noqa: F401 - re-exported
from rlcheck.core.stats.backend import BACKENDS
from rlcheck.core.types import Offender, rank_offenders
from rlcheck.errors import ConfigError

F32_SAFE = 20.0
"""Below this |d|, float32 exponentials and their squared sums cannot overflow: both implementations
(`partial`, `torch_partial`) work float32 batches in float32 up to it, in float64 past it."""
R_FROM_E = -4.0
"""While every d is above this, sum r and sum r^2 come from the sums of e = r - 1 (r^2 > e^-8, so
sum e^2 + 2 sum e + n loses at most ~4 digits); below it, from exp(d) itself."""


@dataclass(frozen=True)
class StatsConfig:
    """What the statistics count as divergent; defaults are written once, here."""

    thresholds: tuple[float, ...] = (0.1, 0.5, 1.0)
    """|d| levels whose token fraction is reported (`token/frac_abs_diff_gt_<t>`)."""
    divergence_tau: float = 0.5
    """|d| above which a token diverges: first-divergence position and flagged sequences."""
    catastrophic_tau: float = 2.0
    """|d| at or above this (a probability off by e^2 ~ 7x) is a catastrophic token."""
    catastrophic_min_frac: float = 0.05
    """A sequence is catastrophic when at least this fraction of its valid tokens is catastrophic (and
    at least `catastrophic_min_tokens` of them), or it holds a non-finite token. A rate, not the
    sequence's max |d|: a healthy bf16 run samples the odd low-probability token at |d| of several
    nats, so the max grows with length (the 1,024-token real loop here: 1.25% of its sequences
    reach max |d| >= 2, while 0.001% of its tokens do); a broken state or index garbles a good part
    of its sequence (the fault zoo's confident gibberish puts 8-16% of the tokens of a random tiny
    model past 2 nats; BENCHMARKS.md, "Field fidelity")."""
    catastrophic_min_tokens: int = 3
    """...so that the odd tail tokens of a short response do not make it catastrophic (a healthy
    real loop here had a 4-token response with two adjacent tokens at 2.9 and 5.4 nats)."""
    clip: float = 0.5
    """`token/abs_diff_clipped_mean` averages min(|d|, clip): the rolling detectors watch it, so one
    tail token moves a step's level by at most clip / tokens."""
    early_window: int = 4
    """A catastrophic sequence whose first divergence is before this position diverged early."""
    early_span: int = 32
    """The early clause of a catastrophic sequence counts its diverged and catastrophic tokens within
    this many leading tokens: a stale state garbles the start of a response, while a long healthy
    one gathers three tokens past 0.5 nats and one past 2 somewhere in its thousands (counted over
    the whole sequence, bf16-long-cot's held-out seeds made 24 of their 115,200 healthy sequences
    "early-diverged", and seed 100 halted 14 times; BENCHMARKS.md, "Quarantine")."""
    ratio_c: float = 2.0
    """`ratio/frac_above_c` counts tokens with r > ratio_c."""
    top_k: int = 10
    """Offenders kept per step (sequences with the largest max |d|)."""
    shift_window: int = 32
    """Leading tokens of each sequence used by the shift-by-one statistic."""
    twin_span: int = 16
    """Leading tokens of each sequence searched for twins (`rlcheck.core.stats.twins`: tokens of the step
    scored in identical contexts; a policy's samples part after their first few tokens)."""
    twin_tau: float = 0.2
    """A twin group is split when the engine's logprobs spread more than this times (1 - p)^0.91 apart
    (and the trainer's agree): set for a bf16 engine; the Monitor scales it with the run's floor
    (`rlcheck.core.floors`)."""
    twin_off: float = 3.0
    """A twin group both sides scored alike is off together when its mean d passes this many split bars
    (`twin_tau` (1 - p)^0.91; `rlcheck.core.stats.twins`): the healthy bf16 groups of the demo's trained
    hybrid stay within 1.52, its stale state's 8 to 145 (BENCHMARKS.md, "Groups off together")."""
    distribution: bool = False
    """Compare the next-token distributions beyond the sampled token (`rlcheck/dist/*`: top-K overlap,
    argmax agreement, tail masses and KL(engine || trainer) over the engine's top-K plus one tail
    bucket, a lower bound on the full KL; `rlcheck.core.stats.distribution`) on batches that carry
    `StepBatch.topk`. Costs a sort of 2K ids per token on the CPU (about 2 s per million tokens at
    K = 20), on top of the engine returning K logprobs and the trainer scoring them; off, or without
    topk, no `dist/` key is logged."""
    turn_head_tokens: int = 4
    """A multi-turn batch's turn head: the first this many tokens of each turn from the second on, right
    after an observation (`rlcheck/turn/head/*` against `rlcheck/turn/body/*`): a generation prompt
    missing from the trainer's later turns, a join token mis-masked, a retokenized junction show there."""
    backend: str = "auto"
    """Implementation of the statistics (`rlcheck.core.stats.backend`): "auto" (eager torch on a batch
    holding GPU tensors, on their device; numpy on host batches, the faster on a CPU), "numpy",
    "torch" (token pass through torch.compile, eager where compilation fails) or "torch-eager".
    Every backend gives the same statistics (float rounding aside); `RLCHECK_STATS_BACKEND`
    overrides "auto"."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if any(not (t > 0 and math.isfinite(t)) for t in self.thresholds):
            raise ConfigError(f"thresholds must be positive and finite, got {self.thresholds}")
        for name in ("divergence_tau", "catastrophic_tau"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.ratio_c > 1:
            raise ConfigError(f"ratio_c must be > 1, got {self.ratio_c}")
        if self.catastrophic_tau < self.divergence_tau:
            raise ConfigError("catastrophic_tau must be >= divergence_tau (a catastrophic sequence has diverged)")
        keys = [f"{t:g}" for t in self.thresholds]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"thresholds must differ in their first 6 significant digits, got {self.thresholds}")
        if not 0 < self.catastrophic_min_frac <= 1:
            raise ConfigError(f"catastrophic_min_frac must be in (0, 1], got {self.catastrophic_min_frac}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ConfigError(f"clip must be positive and finite, got {self.clip}")
        if not self.twin_tau > 0:
            raise ConfigError(f"twin_tau must be positive, got {self.twin_tau}")
        if not self.twin_off > 0:
            raise ConfigError(f"twin_off must be positive, got {self.twin_off}")
        for name in ("early_window", "early_span", "top_k", "shift_window", "catastrophic_min_tokens", "twin_span",
                     "turn_head_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


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
    versions: dict[int, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    """weight version -> (sequences generated by it, the first MAX_VERSION_IDS of their request ids);
    empty when the batch carried no `weight_version`."""


MAX_VERSION_IDS = 20
"""Request ids kept per weight version (what a `weights` alarm names)."""


def merge_versions(parts: Sequence[dict[int, tuple[int, tuple[str, ...]]]]) -> dict[int, tuple[int, tuple[str, ...]]]:
    """Per-version sequence counts summed and request ids joined (in order, at most MAX_VERSION_IDS)."""
    out: dict[int, tuple[int, tuple[str, ...]]] = {}
    for part in parts:
        for version, (count, ids) in part.items():
            seen, kept = out.get(version, (0, ()))
            out[version] = (seen + count, (kept + tuple(ids))[:MAX_VERSION_IDS])
    return dict(sorted(out.items()))


def merge(parts: Sequence[PartialStats], top_k: int | None = None) -> PartialStats:
    """Combine partial statistics of disjoint sequence sets, given in batch order (rank 0 first):
    offender indices are shifted so they count from the start of the combined batch."""
    if not parts:
        raise ConfigError("merge needs at least one PartialStats")
    first = parts[0]
    offenders: list[Offender] = []
    offset = 0
    for p in parts:
        offenders += [replace(o, index=o.index + offset) for o in p.offenders]
        offset += p.num_sequences
    k = top_k if top_k is not None else first.top_k
    def keys(name: str) -> list[str]:  # a part without turns lacks the "turn/..." keys: they count 0 there
        return list(dict.fromkeys(k for p in parts for k in getattr(p, name)))

    return PartialStats(
        sums={key: sum(p.sums.get(key, 0.0) for p in parts) for key in keys("sums")},
        maxima={key: max(p.maxima.get(key, -math.inf) for p in parts) for key in keys("maxima")},
        minima={key: min(p.minima.get(key, math.inf) for p in parts) for key in keys("minima")},
        hists={key: np.sum([p.hists[key] for p in parts], axis=0) for key in first.hists},
        offenders=rank_offenders(offenders, k),
        num_sequences=offset,
        thresholds=first.thresholds,
        top_k=k,
        versions=merge_versions([p.versions for p in parts]),
    )
