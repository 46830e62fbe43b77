"""What a fault is: hooks the loop calls, the shape it should leave, and the cause diagnose should name."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class Fault:
    """No fault: every hook leaves the loop alone. Subclasses override the hooks they need:

    - `trainer_config(cfg)`: the trainer's config as the fault leaves it (before the actors start);
    - `rollout_config(cfg)`: the rollout engine's `VLLMConfig` as the fault leaves it (before it starts);
    - `skip_sync(step)`: True to leave out the weight sync after the update of `step`;
    - `sync_spoil(step)`: how that sync spoils what it sends, and still counts as done (`spoil_sync`):
      "PATTERN" leaves out every tensor whose name contains it, "permute:PATTERN" rolls their output
      rows by one (None: send everything as it is);
    - `apply(step, batch)`: the step's comparison data as the fault corrupts it, and the request ids
      it touched (ground truth for tests; the monitor and diagnose never see it).
    """

    start: int = field(default=0, kw_only=True)
    """First step the fault acts on."""
    seed: int = field(default=0, kw_only=True)

    name: ClassVar[str] = "none"
    cause: ClassVar[str] = "healthy"
    """The cause `rlcheck diagnose` should name (a key of `rlcheck.forensics.diagnose.CAUSES`)."""
    shape: ClassVar[str] = "healthy"
    takes_value: ClassVar[bool] = False
    spoils_syncs: ClassVar[bool] = False
    """Every sync leaves the engine with other weights than the trainer's (the rollouts after it are
    the fault's: ground truth for `fault_touched`)."""

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ConfigError(f"{self.name}: the start step must be >= 0, got {self.start}")

    def trainer_config(self, cfg):
        return cfg

    def rollout_config(self, cfg):
        """An engine fault hooks vLLM's model runner: its engine is built hookable (eager, the V1
        runner; `VLLMConfig.hookable`, a no-op on the CPU backend)."""
        return replace(cfg, hookable=True) if self.engine_fault() is not None else cfg

    def skip_sync(self, step: int) -> bool:
        return False

    def sync_spoil(self, step: int) -> str | None:
        return None

    def engine_fault(self):
        """(fault, options) for `rlcheck.engines.vllm_faults.inject` on the rollout engine, or None."""
        return None

    def active(self, step: int) -> bool:
        return step >= self.start

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        return batch, []

    def value(self) -> str | None:
        """The VALUE of NAME=VALUE, None for a fault without one."""
        return None

    def describe(self) -> str:
        """The spec that parses back to this fault (`parse_inject`)."""
        v = self.value()
        return self.name + ("" if v is None else f"={v}") + (f"@{self.start}" if self.start else "")

    def rng(self, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step, 0x5EED])


def all_ids(batch: StepBatch) -> list[str]:
    return list(batch.request_ids)


def per_sequence(batch: StepBatch):
    """(start, stop) token offsets of every sequence."""
    cu = batch.cu_seqlens
    return zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)


PERMUTE = "permute:"


def spoil_sync(named, spec: str | None):
    """The (name, tensor) pairs a sync spoiled by `spec` (`Fault.sync_spoil`) sends: "PATTERN" leaves out
    the tensors whose name contains it, "permute:PATTERN" rolls their output rows (dim 0) by one, so
    every value is there in another order; None: all of them as they are."""
    if not spec:
        return named
    if spec.startswith(PERMUTE):
        pattern = spec.removeprefix(PERMUTE)
        return ((n, t.roll(1, 0) if pattern in n and t.dim() else t) for n, t in named)
    return ((n, t) for n, t in named if spec not in n)
