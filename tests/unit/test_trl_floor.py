"""The policy copy TRL's measured floor scores with (`rlcheck.integrations.trl.floor.LowCopy`): made once in the
engine's dtype, its weights copied again from the policy after the trainer steps (the real TRL run:
tests/integration/test_trl.py, `test_a_float32_trainer_under_a_bf16_engine_measures_its_floor`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from rlcheck.core.floors import Precision  # noqa: E402
from rlcheck.integrations.trl.floor import LowCopy, floor_sample  # noqa: E402


def trainer_of(model):
    """What LowCopy reads of a GRPOTrainer: its accelerator's unwrap_model and state.global_step."""
    return SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m),
                           state=SimpleNamespace(global_step=0))


def test_made_once_and_refreshed_after_a_step():
    model = torch.nn.Linear(4, 4)
    trainer, low = trainer_of(model), LowCopy()
    first = low.of(trainer, torch.bfloat16)
    assert first.weight.dtype == torch.bfloat16 and model.weight.dtype == torch.float32 and not first.training
    with torch.no_grad():
        model.weight.add_(1.0)
    assert low.of(trainer, torch.bfloat16) is first and not torch.allclose(first.weight.float(), model.weight, atol=0.1)
    trainer.state.global_step = 1  # the trainer stepped: the copy takes the new weights
    assert low.of(trainer, torch.bfloat16) is first
    assert torch.allclose(first.weight.float(), model.weight, atol=1e-2)


def test_nothing_measured_where_the_engine_is_not_coarser():
    """Same dtypes, an engine finer than the trainer, or an unknown side: None, nothing scored (no output read)."""
    trainer = trainer_of(torch.nn.Linear(2, 2))
    for precision in (Precision("bfloat16", "bfloat16"), Precision("float32", "bfloat16"), Precision(None, "float32")):
        assert floor_sample(trainer, {}, None, precision, LowCopy(), 1.0) is None
