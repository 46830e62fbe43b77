"""`ReproConfig`: what `rlcheck repro` does and how much it may spend; `ReproResult`: what it found."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.forensics.repro.shrink import SHRINK_AXES

REPRODUCED, NOTHING, TRAINER_SIDE, NOT_REPRODUCIBLE = "reproduced", "nothing", "trainer_side", "not_reproducible"
VERDICTS = (REPRODUCED, NOTHING, TRAINER_SIDE, NOT_REPRODUCIBLE)


@dataclass(frozen=True)
class ReproConfig:
    confirmations: int = 3
    """k: the recorded case must fail in k of k fresh engines before anything is shrunk."""
    budget: int = 150
    """Probes (fresh engines) the shrink and the knob table may run; the confirmations, the audits,
    localize and the written script's own runs come on top."""
    axes: tuple[str, ...] = SHRINK_AXES
    """What the shrink may take away (`SHRINK_AXES`); the others are named as not searched."""
    compiled: bool = True
    """Try vLLM's compiled default (enforce_eager off) in the shrink and the knob table; False keeps the
    recorded eager setting (a compiled engine costs tens of seconds on CPU) and says it was not searched."""
    shape: bool = True
    """The knob table: the minimal case with one knob (or the arrival order) changed at a time."""
    evidence: bool = True
    """The first divergent layer (localize) and the decode-prefill and batch-invariance audits."""
    verify: bool = True
    """Run the written repro.py (with the injected fault, and for one without it too) and keep its output."""
    copy_model_limit: int = 64 << 20
    """A model folder up to this many bytes is copied into the output (the folder then runs anywhere);
    a larger one is named by its path."""

    def __post_init__(self) -> None:
        if self.confirmations < 1 or self.budget < 0:
            raise ConfigError(f"need confirmations >= 1 and budget >= 0, got {self.confirmations} and {self.budget}")
        object.__setattr__(self, "axes", tuple(self.axes))
        unknown = sorted(set(self.axes) - set(SHRINK_AXES))
        if unknown:
            raise ConfigError(f"unknown shrink axes {', '.join(unknown)}; choose from {', '.join(SHRINK_AXES)}")


@dataclass
class ReproResult:
    verdict: str  # one of VERDICTS
    message: str  # the verdict in words (printed)
    out: Path
    source: Any  # `rlcheck.forensics.repro.source.Source`
    confirmed: int = 0  # fresh engines in which the recorded case failed
    confirmations: int = 0  # of how many
    first_probe: Any = None  # the first confirmation's Probe
    shrunk: Any = None  # `Shrunk`
    table: tuple[Any, ...] = ()  # knob table rows
    table_note: str | None = None
    localized: list[Any] = field(default_factory=list)  # RequestLocalization of the failing requests
    localize_note: str | None = None
    audits: dict[str, Any] = field(default_factory=dict)
    sides: Any = None  # `Sides`, for a failure that does not come back
    diagnosis: str | None = None  # diagnose's verdict on the run, in words
    script: dict[str, Any] = field(default_factory=dict)  # the written repro.py's runs: {"with the fault": {...}}
    probes: int = 0  # budgeted probes run
    budget: int = 0  # of how many
    seconds: dict[str, float] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 when a reproducer was written, 0 otherwise (nothing to reproduce, the trainer's side, not reproducible)."""
        return 1 if self.verdict == REPRODUCED else 0
