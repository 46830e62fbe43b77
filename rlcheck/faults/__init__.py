"""Faults injected on purpose, to show the monitor catching what it claims (`rlcheck demo --inject`).

A fault is given as `NAME=VALUE` text (`parse_inject("skip-sync-every=4")`) and acts through hooks
the loop calls; each documents the failure shape it should leave.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcheck.errors import ConfigError


class Fault:
    """No fault: every hook leaves the loop alone."""

    name = "none"
    shape = "healthy"

    def skip_sync(self, step: int) -> bool:
        """True to leave out the weight sync that follows the update of `step`."""
        return False

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class SkipSync(Fault):
    """The weight sync after every K-th update does not happen, so the rollouts of steps 0 mod K
    (K, 2K, ...) come from weights one update old. Shape: a mismatch spike every K steps at phase 0
    (periodic), between clean steps; its size is that of one update."""

    every: int
    name = "skip-sync-every"
    shape = "weights not synced (periodic)"

    def __post_init__(self) -> None:
        if self.every < 2:
            raise ConfigError(f"skip-sync-every needs K >= 2 (K=1 never syncs), got {self.every}")

    def skip_sync(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def describe(self) -> str:
        return f"skip-sync-every={self.every}"


FAULTS = {"skip-sync-every": lambda v: SkipSync(int(v))}


def parse_inject(spec: str | None) -> Fault:
    """`None` or "" -> no fault; "skip-sync-every=4" -> SkipSync(4)."""
    if not spec:
        return Fault()
    name, _, value = spec.partition("=")
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))} (as NAME=VALUE)")
    try:
        return FAULTS[name](value)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"fault {spec!r}: {name} takes an integer, as {name}=4") from None
