"""The engine guard's settings: `GuardConfig` (where its files go, the policy of each check, the ring
buffer and violation bounds, the 32-bit offset limit, the break requests) and the environment
variables that add break requests (RLCHECK_BREAK_ON, RLCHECK_BREAK_PDB), each field validated in
`__post_init__`. The guard itself is `rlcheck.engines.guard`, which re-exports these names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from rlcheck.core.run.guard_record import CHECKS
from rlcheck.errors import ConfigError

POLICIES = ("record", "warn", "raise")
BREAK_ENV, BREAK_PDB_ENV = "RLCHECK_BREAK_ON", "RLCHECK_BREAK_PDB"


@dataclass(frozen=True)
class GuardConfig:
    run_dir: str | None = None
    """Where DIR/guard/ goes (violations.jsonl as they happen; trace.jsonl and summary.json on flush and
    close; break snapshots). None: kept in memory (snapshots then go to runs/guard-break)."""
    policy: str = "warn"
    """What a violation does unless `policies` says otherwise: record, warn or raise (POLICIES)."""
    policies: dict[str, str] = field(default_factory=dict)
    """Per-check policy, {check: policy}; checks: prefill_from_zero, slot_unique, in_pool, offset_fits,
    freed_reinit."""
    capacity: int = 1024
    """Forward steps kept in the ring buffer (the trace)."""
    max_violations: int = 10_000
    """Violations kept (the first per request and check); later ones are only counted."""
    offset_limit: int = 2**31
    """The offset integer's range, in elements (2**31: a signed 32-bit index)."""
    offset_margin: float = 0.5
    """Room to spare: an end offset past offset_margin * offset_limit breaks check (iv)."""
    break_on: tuple[str, ...] = ()
    """Request ids (as `LLM.generate` reports them) to snapshot each step they are scheduled;
    RLCHECK_BREAK_ON adds to them."""
    break_pdb: bool = False
    """Stop in pdb after each snapshot (RLCHECK_BREAK_PDB=1 sets it)."""
    max_snapshots: int = 16
    """Snapshots per break request."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"guard policy must be one of {POLICIES}, got {self.policy!r}")
        for check, policy in self.policies.items():
            if check not in CHECKS or policy not in POLICIES:
                raise ConfigError(f"guard policies: {check!r}: {policy!r}; checks are {sorted(CHECKS)}, "
                                  f"policies {POLICIES}")
        for name in ("capacity", "max_violations", "offset_limit", "max_snapshots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"guard {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.offset_margin <= 1:
            raise ConfigError(f"guard offset_margin must be in (0, 1], got {self.offset_margin}")
        if isinstance(self.break_on, str) or not all(isinstance(r, str) and r for r in self.break_on):
            raise ConfigError(f"guard break_on must be a tuple of request ids, got {self.break_on!r}")

    def policy_for(self, check: str) -> str:
        return self.policies.get(check, self.policy)

    def with_env(self, environ: dict[str, str] | None = None) -> GuardConfig:
        """This config with RLCHECK_BREAK_ON (comma-separated ids) and RLCHECK_BREAK_PDB=1 applied."""
        env = os.environ if environ is None else environ
        ids = tuple(r.strip() for r in env.get(BREAK_ENV, "").split(",") if r.strip())
        pdb = env.get(BREAK_PDB_ENV, "").strip().lower() in ("1", "true", "yes")
        return replace(self, break_on=tuple(dict.fromkeys(self.break_on + ids)), break_pdb=self.break_pdb or pdb)
