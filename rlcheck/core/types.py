"""The leaf of types every layer reads: a detector's `Alarm`, a worst sequence (`Offender`) and what
one `Monitor.observe` found (`StepReport`). Nothing of rlcheck's is imported here but its errors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.errors import ConfigError

KINDS = ("threshold", "robust_z", "drift", "periodic", "signature", "weights", "quarantine")
SEVERITIES = ("info", "warn", "critical")


def severity_rank(severity: str) -> int:
    """0 for info, 1 for warn, 2 for critical."""
    return SEVERITIES.index(severity)


@dataclass(frozen=True)
class Alarm:
    """One finding of one detector at one step."""

    kind: str  # one of KINDS
    metric: str  # the metric key it is about
    step: int
    severity: str  # one of SEVERITIES
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"alarm kind must be one of {KINDS}, got {self.kind!r}")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"alarm severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "metric": self.metric,
            "step": self.step,
            "severity": self.severity,
            "message": self.message,
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Alarm:
        return cls(d["kind"], d["metric"], int(d["step"]), d["severity"], d["message"], dict(d.get("details", {})))


@dataclass(frozen=True)
class Offender:
    """A sequence among the step's worst by max |d|."""

    request_id: str
    index: int  # position of the sequence in the observed batch
    max_abs_diff: float  # over its finite tokens
    first_divergence: int | None  # first token with |d| > divergence_tau (or non-finite); None if none
    length: int
    mean_diff: float  # mean d over its valid tokens
    nonfinite: bool = False
    turn: int | None = None  # multi-turn batches: the turn of its first divergence ...
    turn_offset: int | None = None  # ... and that token's offset in the turn (`rlcheck.core.turns`)

    @property
    def score(self) -> float:
        return math.inf if self.nonfinite else self.max_abs_diff

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "index": self.index,
            "max_abs_diff": self.max_abs_diff,
            "first_divergence": self.first_divergence,
            "length": self.length,
            "mean_diff": self.mean_diff,
            "nonfinite": self.nonfinite,
            "turn": self.turn,
            "turn_offset": self.turn_offset,
        }


def rank_offenders(offenders: Sequence[Offender], k: int) -> tuple[Offender, ...]:
    return tuple(sorted(offenders, key=lambda o: (-o.score, o.index))[:k])


@dataclass
class StepReport:
    """What one `observe` call found. `keep` and `quarantined` (`rlcheck.core.quarantine`): per
    sequence of the observed batch (this rank's, with `observe_across_ranks`), in batch order; with
    quarantine off every sequence is kept. `correction`, `token_weights` and `sequence_weights`
    compute the importance-sampling correction of the batch (`rlcheck.core.correction`, verl's names
    and defaults; on a multi-turn batch the sequence level is exp(mean d), `rlcheck.core.turn_correction`); they
    need the batch, which the report holds until `release()`."""

    step: int
    metrics: dict[str, float]
    alarms: list[Alarm]
    offenders: tuple[Offender, ...]
    halted: bool = False
    halt_reason: str = ""
    keep: Any = None  # (N,) bool numpy array, or None when the step's batch was not given
    quarantined: tuple[Any, ...] = ()  # `rlcheck.core.quarantine.Quarantined`, batch order
    batch: Any = field(default=None, repr=False, compare=False)  # the observed StepBatch
    corrections: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    """The corrections of `batch` computed already, by `CorrectionConfig` (the Monitor's own, for its
    `rlcheck/corr/*` metrics): `correction` with the same settings hands it out, not computed twice."""

    def release(self) -> None:
        """Drop the batch (a report kept for long should not hold its step's tokens)."""
        self.batch = None
        self.corrections = {}

    def correction(self, rollout_is: str | None = None, rollout_is_threshold: float | str = 2.0,
                   rollout_rs: str | None = None, rollout_rs_threshold: float | str | None = None,
                   rollout_is_batch_normalize: bool = False) -> Any:
        """The step's `rlcheck.core.correction.Correction`: per token (packed like the batch) the IS
        weight and the response mask (valid tokens of kept sequences, not rejected), and verl's
        metrics. Arguments: verl's `rollout_correction` fields, with its defaults."""
        from rlcheck.core.correction import CorrectionConfig, correct

        cfg = CorrectionConfig(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold,
                               rollout_is_batch_normalize)
        b = self._batch()
        if cfg not in self.corrections:
            self.corrections[cfg] = correct(b, self.keep, cfg)
        return self.corrections[cfg]

    def token_weights(self, rollout_is: str | None = "token", rollout_is_threshold: float | str = 2.0,
                      rollout_rs: str | None = None, rollout_rs_threshold: float | str | None = None,
                      rollout_is_batch_normalize: bool = False) -> np.ndarray:
        """(M,) float32, packed like the batch: each token's weight in the loss, 0 for a token of a
        quarantined or rejected sequence (or a masked / non-finite one). Default: token TIS, cap 2."""
        return self.correction(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold,
                               rollout_is_batch_normalize).weights

    def sequence_weights(self, rollout_is: str | None = "sequence", rollout_is_threshold: float | str = 2.0,
                         rollout_rs: str | None = None, rollout_rs_threshold: float | str | None = None,
                         rollout_is_batch_normalize: bool = False) -> np.ndarray:
        """(N,) float32, one per sequence: its sequence-level IS weight (default: sequence TIS, cap 2;
        None: 1), 0 where it is quarantined or rejected by a sequence-level `rollout_rs`."""
        from rlcheck.core.correction import CorrectionConfig, sequence_weights_of

        args = (rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, rollout_is_batch_normalize)
        b = self._batch()
        keep = np.ones(b.num_sequences, dtype=bool) if self.keep is None else self.keep
        return sequence_weights_of(self.correction(*args), b.cu_seqlens, keep, CorrectionConfig(*args))

    def _batch(self) -> Any:
        if self.batch is None:
            raise ConfigError(
                f"the report of step {self.step} holds no batch (observed from statistics alone, or released): "
                "the correction needs the step's tokens; call Monitor.observe with the batch"
            )
        return self.batch
