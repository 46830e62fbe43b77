"""Trainers on the tiny models: the hf `PolicyTrainer` scores as `HFScorer` does, and an FSDP2 or
DeepSpeed ZeRO `TrainerGroup` of two Ray ranks gives the same logprobs, gradient norm and weights
as one plain process, step after step.

The sequences are ragged and split into several micro-batches per rank (a small token budget), with
a count that leaves one rank an empty micro-batch, and the micro-batch count changes between steps.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rlcheck.engines.hf import HFScorer, HFScorerConfig  # noqa: E402
from rlcheck.modelzoo import ModelSpec  # noqa: E402
from rlcheck.trainers import (  # noqa: E402
    PolicyTrainer,
    Sequences,
    TrainerConfig,
    group_advantages,
    plan_micro_batches,
)

VOCAB = ModelSpec().vocab_size
FIRST_PLAIN_ID = 3  # ids 0..2 are bos, eos and pad
BUDGET = 40  # tokens per micro-batch: 3 to 7 micro-batches for the sequences below
TEMPERATURE = 0.9
LR = 1e-4
LOGP_ATOL = 2e-5
"""Same weights, different batching and sharding: float32 reduction order only (measured <= 3e-6)."""
LOGP_ATOL_UPDATED = 1e-3
"""After updates: the weights differ by the noise `assert_weights_close` allows, which moves
logprobs by up to 2e-4 (measured, hybrid after two steps) while the steps moved them by 3-7 nats."""


def sequences(seed: int, n: int) -> Sequences:
    """`n` random sequences: prompts of 2-11 tokens, responses of 1-19."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(FIRST_PLAIN_ID, VOCAB, rng.integers(2, 12)).tolist() for _ in range(n)]
    responses = [rng.integers(FIRST_PLAIN_ID, VOCAB, rng.integers(1, 20)).tolist() for _ in range(n)]
    return Sequences.build(prompts, responses)


def update_inputs(seqs: Sequences, old_logp: list[np.ndarray], seed: int) -> Sequences:
    """GRPO advantages of random rewards (groups of 4, the last one cut short), on-policy old logprobs."""
    rewards = np.random.default_rng(seed).uniform(0, 1, -(-len(seqs) // 4) * 4)
    return seqs.with_update_inputs(group_advantages(rewards, 4)[: len(seqs)], old_logp)


def in_order(by_index: dict[int, np.ndarray]) -> list[np.ndarray]:
    return [by_index[i] for i in range(len(by_index))]


def assert_logprobs_close(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == np.float32, i
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol, err_msg=f"sequence {i}")


def assert_weights_close(got: dict, want: dict, before: dict) -> None:
    """`got` equals `want` up to float32 noise amplified by Adam, and the step moved the weights.

    The first AdamW updates are about lr * g / (|g| + eps) with eps = 1e-8: an element whose gradient
    is itself ~1e-8 (a few in 1e5 here) swings by a few % of lr under the summation-order noise of its
    gradient (~1e-10). Measured over all backends and both models: the 99.9th percentile of |got - want|
    is <= 1.5e-4 lr, the maximum 0.06 lr. A wrong gradient (a micro-batch lost or counted twice, one
    rank's share dropped, mis-scaled accumulation) moves most elements by ~lr.
    """
    assert got.keys() == want.keys()
    names = sorted(want)
    diff = torch.cat([(got[n] - want[n]).abs().flatten() for n in names]) / LR
    moved = torch.cat([(want[n] - before[n]).abs().flatten() for n in names]) / LR
    assert moved.median() > 0.3, "the step left the weights (nearly) where they were"
    assert diff.quantile(0.999) < 1e-3, f"99.9% of weights within 1e-3 lr; got {diff.quantile(0.999):.2e} lr"
    assert diff.max() < 0.25, f"max |weight difference| {diff.max():.3f} lr"


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestPolicyTrainer:
    @pytest.mark.parametrize("arch, packed", [("llama", True), ("hybrid", False)])
    def test_logprobs_equal_hf_scorer(self, tiny_model, arch, packed):
        """Scored over several micro-batches (packed or padded), logprobs equal HFScorer's, each
        micro-batch's copied to the host at once."""
        model = str(tiny_model(arch))
        trainer = PolicyTrainer(TrainerConfig(model=model, backend="hf", micro_batch_tokens=BUDGET,
                                              temperature=TEMPERATURE))
        assert trainer.packed is packed
        seqs = sequences(0, 11)
        plan = plan_micro_batches(seqs, 1, BUDGET)
        assert plan.num_micro_batches >= 5 and max(len(mb) for mb in plan.ranks[0]) > 1
        copies = []
        real_cpu = torch.Tensor.cpu
        torch.Tensor.cpu = lambda self, *a, **k: copies.append(tuple(self.shape)) or real_cpu(self, *a, **k)
        try:
            got = trainer.logprobs(seqs, plan)
        finally:
            torch.Tensor.cpu = real_cpu
        assert sorted(got) == list(range(len(seqs)))
        assert len(copies) == plan.num_micro_batches  # one copy to the host per micro-batch, not per sequence
        want = HFScorer(HFScorerConfig(model=model)).score(seqs.prompts, seqs.responses, temperature=TEMPERATURE)
        assert_logprobs_close(in_order(got), want, atol=1e-5)

    def test_accumulation_equals_one_batch(self, tiny_model):
        """A step over many micro-batches gives the loss, grad norm and weights of one big batch."""
        model = str(tiny_model("llama"))
        small = PolicyTrainer(TrainerConfig(model=model, backend="hf", lr=LR, micro_batch_tokens=BUDGET))
        whole = PolicyTrainer(TrainerConfig(model=model, backend="hf", lr=LR, micro_batch_tokens=10_000))
        seqs = sequences(1, 9)
        plans = [plan_micro_batches(seqs, 1, t.cfg.micro_batch_tokens) for t in (small, whole)]
        assert plans[0].num_micro_batches >= 4 and plans[1].num_micro_batches == 1
        batch = update_inputs(seqs, in_order(whole.logprobs(seqs, plans[1])), seed=1)
        before = dict(whole.full_state_dict())
        got, want = small.train_step(batch, plans[0]), whole.train_step(batch, plans[1])
        assert got["loss_sum"] == pytest.approx(want["loss_sum"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert_weights_close(dict(small.full_state_dict()), dict(whole.full_state_dict()), before)

    def test_moe_routing_read_in_the_recompute_forward(self, tiny_model):
        """On the tiny MoE the trainer's recompute also returns each response token's experts, read by
        the routers' hooks in the same packed forward: equal to one unpacked forward per sequence,
        and the logprobs are the plain call's."""
        from rlcheck.engines.moe_routing import response_rows
        from rlcheck.trainers.moe_routing import RouteRecorder

        model = str(tiny_model("moe"))
        trainer = PolicyTrainer(TrainerConfig(model=model, backend="hf", micro_batch_tokens=BUDGET))
        seqs = sequences(4, 7)
        plan = plan_micro_batches(seqs, 1, BUDGET)
        got = trainer.topk_logprobs(seqs, plan, 0, routing=True)
        plain = trainer.logprobs(seqs, plan)
        module = trainer.backend.module
        for i in range(len(seqs)):
            logp, at, own, experts = got[i]
            assert at is None and own is None and np.array_equal(logp, plain[i])
            ids = torch.tensor([list(seqs.prompts[i]) + list(seqs.responses[i])])
            with RouteRecorder(module) as routes, torch.no_grad():
                module(ids)
            want = response_rows(routes.experts(), np.arange(ids.shape[1]), len(seqs.prompts[i]), len(seqs.responses[i]))
            assert experts.shape == (len(seqs.responses[i]), 2, 2) and np.array_equal(np.sort(experts, -1), np.sort(want, -1))

    def test_tied_weights_gathered_once_under_both_names(self, tiny_model, tmp_path):
        """A tied model's synced weights hold `lm_head.weight` and `model.embed_tokens.weight` as one
        host tensor (gathered and copied once; the engine needs both names), fresh at every call."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(tmp_path)
        trainer = PolicyTrainer(TrainerConfig(model=str(tmp_path), backend="hf"))
        first, second = dict(trainer.full_state_dict()), dict(trainer.full_state_dict())
        assert first["lm_head.weight"] is first["model.embed_tokens.weight"]
        assert first.keys() == trainer.backend.module.state_dict().keys()
        assert all(first[n] is not second[n] and torch.equal(first[n], second[n]) for n in first)

    def test_train_step_needs_update_inputs(self, tiny_model):
        """Sequences without advantages and old logprobs are refused before any forward."""
        trainer = PolicyTrainer(TrainerConfig(model=str(tiny_model("llama")), backend="hf"))
        seqs = sequences(2, 3)
        with pytest.raises(ValueError, match="advantages and old_logp"):
            trainer.train_step(seqs, plan_micro_batches(seqs, 1, BUDGET))

    def test_plan_for_another_world_size_refused(self, tiny_model):
        """A plan made for two ranks is refused by a one-process trainer."""
        trainer = PolicyTrainer(TrainerConfig(model=str(tiny_model("llama")), backend="hf"))
        seqs = sequences(3, 4)
        with pytest.raises(ValueError, match="plan is for 2 ranks"):
            trainer.logprobs(seqs, plan_micro_batches(seqs, 2, BUDGET))


@pytest.mark.slow
@pytest.mark.timeout(300)
class TestTrainerGroup:
    @pytest.mark.parametrize("arch, backend, zero_stage", [
        ("llama", "fsdp2", 3),
        ("llama", "deepspeed", 3),
        ("llama", "deepspeed", 1),
        ("hybrid", "fsdp2", 3),
    ], ids=["fsdp2-llama", "zero3-llama", "zero1-llama", "fsdp2-hybrid"])
    def test_equals_single_process_hf(self, tiny_model, ray_local, arch, backend, zero_stage):
        """Two Ray ranks give the plain process's logprobs, loss, grad norm and weights, over two steps."""
        from rlcheck.loop.group import TrainerGroup

        if backend == "deepspeed":
            pytest.importorskip("deepspeed")
        cfg = TrainerConfig(model=str(tiny_model(arch)), backend=backend, zero_stage=zero_stage, lr=LR,
                            micro_batch_tokens=BUDGET, temperature=TEMPERATURE)
        ref = PolicyTrainer(replace(cfg, backend="hf"))
        group = TrainerGroup(cfg, world_size=2)
        try:
            counts = []
            for step, n in enumerate((7, 12)):
                seqs = sequences(step, n)  # plans of 3, then 4 micro-batches per rank
                plan, ref_plan = group.plan(seqs), plan_micro_batches(seqs, 1, BUDGET)
                assert any(() in rank for rank in plan.ranks)  # one rank runs an empty micro-batch
                counts.append(plan.num_micro_batches)
                want = in_order(ref.logprobs(seqs, ref_plan))
                assert_logprobs_close(group.logprobs(seqs, plan), want, LOGP_ATOL if step == 0 else LOGP_ATOL_UPDATED)

                batch = update_inputs(seqs, want, seed=step)
                before = dict(ref.full_state_dict())
                got, expect = group.train_step(batch, plan), ref.train_step(batch, ref_plan)
                assert got["loss"] == pytest.approx(expect["loss_sum"] / seqs.num_response_tokens, rel=1e-5)
                assert got["grad_norm"] == pytest.approx(expect["grad_norm"], rel=1e-5)  # catches loss scaling
                weights = dict(ray_local.get(group.full_state_dict_ref()))
                assert_weights_close(weights, dict(ref.full_state_dict()), before)

                after = in_order(ref.logprobs(seqs, ref_plan))
                assert max(np.abs(a - w).max() for a, w in zip(after, want, strict=True)) > 1.0
                assert_logprobs_close(group.logprobs(seqs, plan), after, LOGP_ATOL_UPDATED)
            assert counts[0] >= 3 and counts[1] != counts[0]  # accumulation, and a new count per step
        finally:
            group.shutdown()
