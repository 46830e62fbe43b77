"""What a fault is: hooks the loop calls, the shape it should leave, and the cause diagnose should name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class TrainerInputs:
    """The token ids a trainer-side fault has the trainer score, one entry per sequence."""

    prompts: list[list[int]]
    """The trainer's prompt ids, as it holds (and reports) them."""
    responses: list[list[int]]
    """The trainer's response ids: it scores these, and its logprobs are laid against the engine's
    tokens by position (a shorter response leaves the engine's last tokens unscored)."""
    left_pad: list[int] | None = None
    """Pad tokens the trainer puts before each prompt in its row and attends to, without position
    ids: its positions shift by the padding (None: none)."""


@dataclass(frozen=True)
class Fault:
    """No fault: every hook leaves the loop alone. Subclasses override the hooks they need:

    - `trainer_config(cfg)`: the trainer's config as the fault leaves it (before the actors start);
    - `rollout_config(cfg)`: the rollout engine's `VLLMConfig` as the fault leaves it (before it starts);
    - `skip_sync(step)`: True to leave out the weight sync after the update of `step`;
    - `sync_spoil(step)`: how that sync spoils what it sends, and still counts as done (`spoil_sync`):
      "PATTERN" leaves out every tensor whose name contains it, "permute:PATTERN" rolls their output
      rows by one (None: send everything as it is);
    - `prompts(step, prompts, tokenizer)`: the step's prompt ids as the engine (and the trainer) get
      them (a long shared system prompt, `stale-prefix-cache`);
    - `trainer_inputs(step, prompts, responses, texts, tokenizer)`: the token ids the trainer scores
      instead of the engine's (`TrainerInputs`; None: the engine's as they are), laid against the
      engine's tokens by position (`rlcheck.loop.trainer_view`);
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

    def prompts(self, step: int, prompts: list[list[int]], tokenizer: Any) -> list[list[int]]:
        return prompts

    def trainer_inputs(self, step: int, prompts: list[list[int]], responses: list[list[int]], texts: list[str],
                       tokenizer: Any) -> TrainerInputs | None:
        return None

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


def check_factor(name: str, factor: float, start: int, what: str) -> None:
    """ConfigError unless `factor` is a finite number > 0 other than 1 and the fault starts at step 0 (it
    changes `what` before the run)."""
    if not (factor > 0 and math.isfinite(factor)) or factor == 1.0:
        raise ConfigError(f"{name} needs a factor > 0 other than 1, got {factor}")
    if start:
        raise ConfigError(f"{name} acts from the first step (it changes {what})")


def all_ids(batch: StepBatch) -> list[str]:
    return list(batch.request_ids)


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
