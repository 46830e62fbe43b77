"""The trainer's forward at an engine's precision: the model's own noise there, which the loop's measured
floor is (`rlcheck.loop.floor_sample`, `rlcheck.core.floors`).

    with at_precision(trainer, "bfloat16"):
        logps = trainer.logprobs(...)

One process (the `hf` backend): a copy of the model in that dtype, kept and refreshed from the trainer's
weights after each update: the engine's whole path in it (weights, activations, the residual stream, the
norms). Sharded (FSDP2, DeepSpeed): `torch.autocast`, the matmuls only, no second copy of a shard: on the
tiny Llamas as far from the fp32 trainer as a bf16 engine (1.0-1.2x), on the tiny MoE 1.5-6x under it
(BENCHMARKS.md, "A floor measured on the run's model")."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def at_precision(trainer: Any, dtype: str | None) -> Iterator[None]:
    """Within it, `trainer`'s forwards (a `PolicyTrainer`) compute at `dtype`; None: unchanged."""
    if dtype is None:
        yield
        return
    dt = getattr(torch, dtype)
    backend = trainer.backend
    if trainer.cfg.backend != "hf":
        with torch.autocast(torch.device(trainer.cfg.device).type, dtype=dt):
            yield
        return
    real = backend.module
    backend.module = low_copy(trainer, real, dt)
    try:
        yield
    finally:
        backend.module = real


def low_copy(trainer: Any, module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` in `dtype`, kept on the trainer as `precision_copy` and brought up to its `steps_done` (`refreshed`)."""
    trainer.precision_copy = refreshed(trainer.precision_copy, module, dtype, trainer.steps_done)
    return trainer.precision_copy[2]


def refreshed(kept: tuple | None, module: torch.nn.Module, dtype: torch.dtype, version: int) -> tuple:
    """`kept` ((dtype, version, copy), or None) brought up to `module` in `dtype` at `version`: as it is when
    current, its weights copied again from `module` when the version moved, a new copy otherwise (TRL's measured
    floor keeps one too: `rlcheck.integrations.trl.floor`)."""
    if kept is not None and kept[0] == dtype and kept[1] == version:
        return kept
    if kept is not None and kept[0] == dtype:
        low = kept[2]
        with torch.no_grad():
            for a, b in zip(low.state_dict().values(), module.state_dict().values(), strict=True):
                a.copy_(b)
    else:
        low = copy.deepcopy(module).to(dtype)
    return dtype, version, low.eval()
