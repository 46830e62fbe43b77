"""The measured floor inside TRL (as the own loop's, `rlcheck.loop.floor_sample`): where vLLM computes in a dtype
coarser than the trainer's (TRL's vLLM in bf16, "auto" on a float32 checkpoint, under a float32 GRPOTrainer), each
generation's completions are scored once more by a copy of the policy in vLLM's dtype, and the clipped mean |d|
against the trainer's own logprobs is the model's noise at that precision on those tokens: the Monitor judges the
step at it where it is above the precision's level (`rlcheck.core.floors`; `rlcheck/floor/measured`).

The copy (`LowCopy`) is made once and its weights copied again from the policy when the trainer has stepped; one
more no-grad forward per generation. `TRLOptions(measure_floor=False)`: the precision's level only."""

from __future__ import annotations

from typing import Any

from rlcheck.core.floors import Precision, coarser_engine, measured_level
from rlcheck.integrations.trl.batch import response_mask


class LowCopy:
    """The policy in a coarser dtype, refreshed from the trainer's weights after each optimizer step."""

    def __init__(self) -> None:
        self.kept: tuple[Any, int, Any] | None = None  # (dtype, the trainer's global_step it holds, the copy)

    def of(self, trainer: Any, dtype: Any) -> Any:
        from rlcheck.trainers.precision import refreshed

        policy = trainer.accelerator.unwrap_model(trainer.model)
        self.kept = refreshed(self.kept, policy, dtype, trainer.state.global_step)
        return self.kept[2]


def floor_sample(trainer: Any, output: dict, full: Any, precision: Precision, low: LowCopy,
                 clip: float) -> float | None:
    """One generation's measured floor against `full`, the trainer's own logprobs of it (`generation.trainer_logps`),
    or None where vLLM's dtype is not coarser than the trainer's (or unknown)."""
    import torch

    from rlcheck.integrations.trl.generation import recompute

    dtype = coarser_engine(precision.engine, precision.trainer)
    if dtype is None:
        return None
    scored = recompute(trainer, output, low.of(trainer, getattr(torch, dtype)))
    mask = torch.as_tensor(response_mask(output), device=scored.device)
    return measured_level([scored[mask].float().cpu().numpy()], [full[mask].float().cpu().numpy()], clip)
