"""What a preflight finds: one `Finding` per setting on which the engine and the trainer would differ,
and the `Preflight` result (the findings, the probe's numbers) the CLI, the renderer and the
adapters read.

Severity, from mild to fatal (`SEVERITIES`):
- "info": noted, not a difference (e.g. prefix caching on while nobody said who resets it).
- "warn": may make the sides differ, or widens their noise (dtype, a chat template that adds BOS twice).
- "error": certain to make every step differ (RoPE base, raw logprobs at T != 1, top-p with processed logprobs).
- "critical": the comparison itself is meaningless (the token ids mean different strings, logits instead
  of logprobs): the adapters refuse these at attach time (`rlcheck.preflight.attach`).
`rlcheck preflight` exits 1 when any finding is "warn" or worse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck.core.sync_check import ProbeResult

SEVERITIES = ("info", "warn", "error", "critical")
DIFFERS = ("warn", "error", "critical")
"""Severities that count as "the sides would differ" (exit code 1)."""


@dataclass(frozen=True)
class Finding:
    """One setting the two sides disagree on, with the fix in one sentence."""

    key: str
    """What differs, e.g. "rope_theta", "logprobs_mode", "double_bos" (stable: scripts match on it)."""
    severity: str
    """One of `SEVERITIES`."""
    trainer: Any
    """The trainer side's value (None: not applicable)."""
    engine: Any
    """The engine side's value (None: not applicable)."""
    message: str
    """What it does to the comparison."""
    fix: str
    """How to make the sides agree, one sentence."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    @property
    def differs(self) -> bool:
        return self.severity in DIFFERS

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "severity": self.severity, "trainer": _plain(self.trainer),
                "engine": _plain(self.engine), "message": self.message, "fix": self.fix}


@dataclass(frozen=True)
class Preflight:
    """A preflight's result: every finding, worst first, and the probe's numbers when it ran."""

    trainer_model: str
    engine_model: str
    findings: tuple[Finding, ...] = ()
    probe: ProbeResult | None = None
    probe_note: str | None = None
    """Why the probe did not run (vLLM missing, --no-probe, a critical finding), or None."""

    @property
    def differs(self) -> bool:
        """True when a finding says the sides would differ (exit code 1)."""
        return any(f.differs for f in self.findings)

    def keys(self) -> list[str]:
        return [f.key for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        probe = None
        if self.probe is not None:
            p = self.probe
            probe = {"tokens": p.tokens, "mean_abs": p.mean_abs, "max_abs": p.max_abs, "tolerance": p.tolerance,
                     "ok": p.ok}
        return {"trainer_model": self.trainer_model, "engine_model": self.engine_model, "differs": self.differs,
                "findings": [f.to_dict() for f in self.findings], "probe": probe, "probe_note": self.probe_note}


def worst_first(findings: list[Finding]) -> tuple[Finding, ...]:
    """The findings sorted by severity, worst first (stable within one severity)."""
    return tuple(sorted(findings, key=lambda f: -SEVERITIES.index(f.severity)))


def _plain(value: Any) -> Any:
    """A JSON-safe form of a setting's value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)
