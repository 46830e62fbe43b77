"""Quarantine inside TRL's own loss, on a real trl 1.16 `GRPOTrainer` (the tiny llama, no vLLM: the
loss is computed from a step output built here, with vLLM's importance-sampling correction and a KL
term switched on): for every `loss_type` TRL accepts, the loss and its gradients with two rows
quarantined (one holding NaN logprobs, one an infinite IS ratio) equal those of the batch with the two
rows removed; zeroing their mask alone (the old way) gives NaN, and on finite values a diluted loss for
the losses that average over rows.

The Monitor reads the same tensors whatever the loss_type (TRL's generation step does not look at it;
the fire drills in test_trl.py run TRL's default, dapo): what depends on the loss_type is the
quarantine's loss, proved here for each."""

from __future__ import annotations

import pytest
import torch

from rlcheck.integrations.trl.batch import mask_rows
from rlcheck.integrations.trl.loss import KEEP_KEY, kept_loss, mark_kept

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
ROW_AVERAGED = {"grpo", "sapo", "luspo", "dr_grpo"}  # the kept rows were diluted by (B-k)/B
QUARANTINED = [1, 4]
B, P, C = 6, 3, 5


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    """A real GRPOTrainer on the tiny llama, in train mode, vLLM's IS correction and KL on."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("grpo-loss")), use_cpu=True, report_to=[],
                      per_device_train_batch_size=B, num_generations=3, max_completion_length=C, beta=0.04,
                      use_vllm=False, save_strategy="no", disable_tqdm=True)
    tr = GRPOTrainer(model=str(tiny_model("llama")), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                     args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * B}))
    tr.use_vllm = tr.vllm_importance_sampling_correction = True  # the loss TRL computes with vLLM
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    return tr


def _step_output(model) -> dict:
    """One process's generation batch as TRL's loss reads it: the model's own logprobs (perturbed, so
    ratios are clipped), ragged completions, a bad row 1 (NaN logprobs) and row 4 (infinite IS ratio)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 100, (B, P), generator=g)
    completion = torch.randint(3, 100, (B, C), generator=g)
    lens = torch.tensor([5, 2, 4, 3, 5, 1])
    mask = (torch.arange(C) < lens[:, None]).long()  # (B, C)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion], 1)).logits[:, P - 1:-1].float()
        logps = logits.log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)  # (B, C)
    old = logps + 0.3 * torch.randn(B, C, generator=g)
    sampling = old + 0.05 * torch.randn(B, C, generator=g)
    ratio = torch.exp(old - sampling).clamp(max=2.0)
    sampling[1] = float("nan")
    old[1, 0] = float("nan")
    ratio[4, 1] = float("inf")
    return {"prompt_ids": prompt, "prompt_mask": torch.ones(B, P, dtype=torch.long), "completion_ids": completion,
            "completion_mask": mask, "advantages": torch.randn(B, generator=g), "old_per_token_logps": old,
            "sampling_per_token_logps": sampling, "importance_sampling_ratio": ratio,
            "ref_per_token_logps": logps - 0.1, "num_items_in_batch": mask.sum()}


def _quarantined(output: dict, rows: list[int]) -> dict:
    """What the hook hands TRL: the rows' mask zeroed, their tokens out of num_items_in_batch, kept rows marked."""
    out = dict(output)
    out["num_items_in_batch"] = out["num_items_in_batch"] - mask_rows(out, rows)
    mark_kept(out, rows)
    return out


def _removed(output: dict, rows: list[int]) -> dict:
    """The batch the rows were never sampled in."""
    keep = torch.tensor([i not in rows for i in range(B)])
    out = {k: v[keep] if v.ndim else v for k, v in output.items()}
    out["num_items_in_batch"] = out["completion_mask"].sum()
    return out


def _loss_and_grads(trainer, compute, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.zero_grad()
    loss = compute(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.supports("TRL", "loss_type", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_quarantined_rows_leave_every_loss_type(trainer, loss_type):
    """Loss and gradients with quarantine == the batch without the rows (float tolerance); the mask alone
    gives NaN, and on finite values dilutes the row-averaged losses."""
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
    compute = trainer._compute_loss
    output = _step_output(trainer.model)

    got, got_grads = _loss_and_grads(trainer, lambda m, x: kept_loss(compute, trainer.accelerator, m, x),
                                     _quarantined(output, QUARANTINED))
    want, want_grads = _loss_and_grads(trainer, compute, _removed(output, QUARANTINED))
    assert torch.isfinite(got) and torch.allclose(got, want, rtol=1e-5, atol=1e-7), (float(got), float(want))
    assert len(got_grads) == len(want_grads) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got_grads, want_grads, strict=True))

    masked = _quarantined(output, QUARANTINED)
    del masked[KEEP_KEY]
    assert torch.isnan(compute(trainer.model, masked).detach())  # NaN x 0: the old way
    finite = {k: torch.nan_to_num(v, nan=0.0, posinf=0.0) for k, v in output.items()}
    masked = _quarantined(finite, QUARANTINED)
    del masked[KEEP_KEY]
    diluted = compute(trainer.model, masked).detach()
    assert torch.allclose(diluted, want, rtol=1e-5, atol=1e-7) == (loss_type not in ROW_AVERAGED), float(diluted)


def test_a_micro_batch_all_quarantined_gives_no_loss_and_no_gradient(trainer):
    """Every row quarantined: a zero loss, finite and zero gradients, the forward still run."""
    trainer.loss_type, trainer.importance_sampling_level = "grpo", "token"
    compute = trainer._compute_loss
    loss, grads = _loss_and_grads(trainer, lambda m, x: kept_loss(compute, trainer.accelerator, m, x),
                                  _quarantined(_step_output(trainer.model), list(range(B))))
    assert float(loss) == 0.0 and grads and all(torch.count_nonzero(g) == 0 for g in grads)
