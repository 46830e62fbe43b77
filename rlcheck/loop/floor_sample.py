"""The loop's measured floor: with an engine coarser than the trainer (a bf16 engine, a fp32 trainer) the
trainer scores each step's tokens once more at the engine's dtype (`rlcheck.trainers.precision`), and the clipped mean
|d| against its own logprobs is the model's noise at that precision on those tokens, which the Monitor
judges the step at where it is above the precision's level (`rlcheck.core.floors`).

    sample = floor_sample(loop, seqs, plan, logp_train)    # None: same dtypes, or measure_floor=False
    monitor.observe(step, batch, ..., floor_sample=sample)

Why (BENCHMARKS.md, "A floor measured on the run's model"): the trained tiny MoE with a bf16 engine on an
AVX512-BF16 CPU sits 0.02-0.15 off its fp32 trainer, past the bf16 level the gates were set at, and its
healthy runs alarmed. The hf trainer's bf16 copy measures 0.5-1.3x the engine's noise on the same tokens; no engine
fault reaches it, and a fault in what the trainer scores moves both of its forwards alike."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core.floors import coarser_engine, measured_level


def floor_sample(loop: Any, seqs: Any, plan: Any, logp_train: list[np.ndarray]) -> float | None:
    """This step's measured floor (see the module docstring), or None where none is measured."""
    if not loop.cfg.measure_floor or not len(seqs):
        return None
    dtype = coarser_engine(loop.checker.engine_dtype(loop), loop.cfg.trainer.dtype)
    if dtype is None:
        return None
    low = loop.group.logprobs(seqs, plan, at=dtype)
    return measured_level(low, logp_train, loop.monitor.cfg.stats.clip)
