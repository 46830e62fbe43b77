"""The Monitor's configuration: where it writes (`MonitorConfig`) and when it halts (`HaltConfig`).
Both are re-exported by `rlcheck.core.monitor` and `rlcheck`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.detect import KINDS, SEVERITIES, DetectorsConfig
from rlcheck.core.floors import Floor, Precision  # noqa: F401 - Floor: the Monitor's, from its config
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.stats import StatsConfig
from rlcheck.core.turn_checks import TurnCheckConfig
from rlcheck.errors import ConfigError

DEFAULT_HARD_LIMITS = {
    K.NONFINITE_COUNT: 0.0,  # any NaN/inf logprob
    K.ABS_DIFF_MEAN: 1.0,  # mean |d| of one nat
    K.CATASTROPHIC_TOKEN_FRAC: 0.1,  # a tenth of the tokens off by e^2 or more
    K.SEQ_CATASTROPHIC_FRAC: 0.25,  # a quarter of the sequences far off (a rate of their tokens)
}
"""Each is a level no healthy stream of BENCHMARKS.md "Field fidelity" came near and one tail token
cannot reach; mean exp|d| > 2 was one before, and a single token at |d| = 10 in 20,000 passed it."""


@dataclass(frozen=True)
class HaltConfig:
    """When the Monitor stops the run (docs/halting.md states these defaults)."""

    enabled: bool = True
    kinds: tuple[str, ...] = KINDS
    """Alarm kinds that may halt."""
    min_severity: str = "critical"
    """Alarms below this severity never halt."""
    patience: int = 1
    """Consecutive steps with a halting alarm before the run halts."""
    hard_limits: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_HARD_LIMITS))
    """metric -> limit: exceeding one halts at once (a critical threshold alarm, patience ignored)."""
    dump: bool = True
    """Write the step's forensic dump before raising."""

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ConfigError(f"unknown alarm kinds {sorted(unknown)}; known: {KINDS}")
        if self.min_severity not in SEVERITIES:
            raise ConfigError(f"min_severity must be one of {SEVERITIES}, got {self.min_severity!r}")
        if self.patience < 1:
            raise ConfigError(f"patience must be >= 1, got {self.patience}")
        bad = {k: v for k, v in self.hard_limits.items() if not isinstance(v, (int, float)) or math.isnan(v)}
        if bad:
            raise ConfigError(f"hard limits must be numbers, got {bad}")


@dataclass(frozen=True)
class MonitorConfig:
    run_dir: str | os.PathLike
    """Where metrics.jsonl, state.json, dumps/ and wandb/ go; created if missing."""
    sinks: tuple[Any, ...] = ("jsonl", "console")
    """Views of each step's record: any of "console", "wandb", or your own `rlcheck.sinks.Sink`
    instances. The record itself, metrics.jsonl (what summarize, diagnose and report read), is the
    run's journal and always written; "jsonl" is accepted here and names it."""
    stats: StatsConfig = field(default_factory=StatsConfig)
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    halt: HaltConfig = field(default_factory=HaltConfig)
    wandb: Any = None
    """A `rlcheck.sinks.WandbConfig` for the "wandb" sink (defaults when None)."""
    resume: bool = True
    """Load state.json from run_dir when it exists, so the detectors keep their history; when False,
    a run_dir that already holds a run is refused (nothing is overwritten)."""
    redact: bool = False
    """Keep prompt and response text out of the evidence: dumps get no token ids (prompt, response,
    trainer) and no per-sequence text columns (string meta columns other than ids); meta.json says
    `"redacted": true` and names the dropped columns. metrics.jsonl and W&B never carry tokens or
    text either way (their offenders hold request ids and numbers); `context` is written as given."""
    context: Mapping[str, Any] = field(default_factory=dict)
    """Model, engine and sampling settings, written into every dump's meta.json."""
    max_weight_lag: int = 0
    """Weight versions a sequence may lag the trainer's (`observe(..., trainer_version=V)`): 0 is
    on-policy; an async or off-policy loop sets the staleness it allows."""
    quarantine: QuarantineConfig | None = None
    """Take the sequences the evidence condemns out of the step instead of halting
    (`rlcheck.core.quarantine`; docs/quarantine.md); None (the default): off, every
    sequence is judged and the halt policy alone decides."""
    precision: Precision | None = None
    """The dtypes the engine and the trainer compute their logprobs in: what a healthy run's floor is,
    which the detectors' gates and diagnose's "clean" are relative to (`rlcheck.core.floors`). None: read
    from `context` (the loop's and TRL's name them), else the run calibrates on its first steps."""
    true_on_policy: bool = False
    """Declare that the two sides compute bitwise the same numbers (batch-invariant kernels, deterministic
    inference, the same weights: SGLang's deterministic mode, slime's true on-policy, verl's exact path):
    any difference at all on a compared token is then a critical alarm that halts at once. Off, bitwise
    equal sides read as the best possible health, with one note (`rlcheck.core.inputs.identical_sides`)."""
    turn_checks: TurnCheckConfig | None = field(default_factory=TurnCheckConfig)
    """The cross-turn invariants of multi-turn batches (`StepBatch.turns`; `rlcheck.core.turn_checks`):
    each breach an alarm with its evidence, its sequences quarantined (reason `turn_invariant`) or, with
    quarantine off, a critical alarm; stale turns' tokens masked. None: off. Batches without turns: no cost."""
    correction: CorrectionConfig | None = None
    """Log the metrics of this importance-sampling correction each step (`rlcheck/corr/...`, verl's
    names; needs the batch, so `observe`, not `observe_partial`); the weights themselves come from
    `StepReport.correction` / `token_weights` / `sequence_weights`."""

    def __post_init__(self) -> None:
        if not str(self.run_dir):
            raise ConfigError("run_dir must be a directory path")
        if isinstance(self.sinks, str):
            raise ConfigError(f"sinks is a tuple of names, e.g. ({self.sinks!r},)")
        if isinstance(self.max_weight_lag, bool) or not isinstance(self.max_weight_lag, int) or self.max_weight_lag < 0:
            raise ConfigError(f"max_weight_lag must be a non-negative integer, got {self.max_weight_lag!r}")
        if self.quarantine is not None and not isinstance(self.quarantine, QuarantineConfig):
            raise ConfigError(f"quarantine must be a QuarantineConfig or None, got {type(self.quarantine).__name__}")
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise ConfigError(f"precision must be a rlcheck.core.floors.Precision or None, got {type(self.precision).__name__}")
        if not isinstance(self.true_on_policy, bool):
            raise ConfigError(f"true_on_policy must be True or False, got {self.true_on_policy!r}")
        if self.turn_checks is not None and not isinstance(self.turn_checks, TurnCheckConfig):
            raise ConfigError(f"turn_checks must be a TurnCheckConfig or None, got {type(self.turn_checks).__name__}")
        if self.correction is not None and not isinstance(self.correction, CorrectionConfig):
            raise ConfigError(f"correction must be a CorrectionConfig or None, got {type(self.correction).__name__}")
        try:
            K.check_names(watched_metrics(self.detectors, self.halt))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def watched_metrics(detectors: DetectorsConfig, halt: HaltConfig) -> list[tuple[str, str]]:
    """(where, metric name) of every rlcheck metric a hard limit, and of every metric a threshold rule or
    a detector, watches (a hard limit may watch the caller's own scalars, observe's `extra`, too)."""
    out = [("HaltConfig.hard_limits", key) for key in halt.hard_limits if key.startswith(K.PREFIX)]  # others: your own
    for name, cfg in vars(detectors).items():
        out += [(f"DetectorsConfig.{name} rule {i}", rule.metric) for i, rule in enumerate(getattr(cfg, "rules", ()))]
        out += [(f"DetectorsConfig.{name}.metrics", m) for m in getattr(cfg, "metrics", ())]
    return out
