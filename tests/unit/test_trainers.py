"""`rlcheck.trainers`' pure parts: the micro-batch plan, `Sequences` validation, GRPO advantages, the
clipped surrogate against a per-token loop, and `TrainerConfig` validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlcheck.errors import ConfigError, InputError
from rlcheck.trainers import (
    MicroBatchPlan,
    Sequences,
    TrainerConfig,
    clipped_surrogate,
    group_advantages,
    plan_micro_batches,
)


def ragged(lengths: list[int]) -> Sequences:
    """Sequences of the given total lengths (>= 2): half prompt, the rest response."""
    prompts = [[1] * max(1, n // 2) for n in lengths]
    responses = [[2] * (n - len(p)) for n, p in zip(lengths, prompts, strict=True)]
    return Sequences.build(prompts, responses)


def random_lengths(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(2, 120, n).tolist()


PLAN_CASES = [(seed, n, w, budget) for seed, (n, w, budget) in enumerate(
    [(1, 1, 10), (7, 2, 50), (8, 2, 2), (13, 3, 100), (5, 4, 64), (31, 2, 1000), (20, 8, 30)]
)]


class TestSequences:
    def test_build_normalises_types(self):
        """`build` stores int tuples and float32 arrays, and reports lengths and token counts."""
        s = Sequences.build([np.array([1, 2]), [3]], [[4, 5, 6], (7,)], advantages=[0.5, -1],
                            old_logp=[[-1.0, -2.0, -3.0], [-0.5]])
        assert s.prompts == ((1, 2), (3,)) and s.responses == ((4, 5, 6), (7,))
        assert all(type(t) is int for t in s.prompts[0])
        assert s.advantages.dtype == np.float32 and s.old_logp[0].dtype == np.float32
        assert (len(s), s.length(0), s.length(1), s.num_response_tokens) == (2, 5, 2, 4)

    def test_with_update_inputs_keeps_tokens(self):
        """`with_update_inputs` attaches advantages and old logprobs to the same tokens."""
        s = Sequences.build([[1]], [[2, 3]]).with_update_inputs([1.5], [np.array([-0.1, -0.2])])
        assert s.prompts == ((1,),) and s.responses == ((2, 3),)
        np.testing.assert_array_equal(s.advantages, np.float32([1.5]))

    @pytest.mark.parametrize("prompts, responses, match", [
        ([], [], "as many prompts"),
        ([[1]], [[2], [3]], "as many prompts"),
        ([[1], []], [[2], [3]], "sequence 1"),
        ([[1], [2]], [[2], []], "sequence 1"),
    ])
    def test_rejects_bad_tokens(self, prompts, responses, match):
        """No sequences, mismatched counts and empty prompts or responses are InputErrors."""
        with pytest.raises(InputError, match=match):
            Sequences.build(prompts, responses)

    def test_rejects_bad_update_inputs(self):
        """Advantages of the wrong count and old logprobs of the wrong length are InputErrors."""
        with pytest.raises(InputError, match="advantages"):
            Sequences.build([[1], [1]], [[2], [2]], advantages=[1.0])
        with pytest.raises(InputError, match=r"old_logp.*\[1\]"):
            Sequences.build([[1], [1]], [[2], [2, 3]], old_logp=[[-1.0], [-1.0]])


class TestPlanMicroBatches:
    @pytest.mark.parametrize("seed, n, world_size, budget", PLAN_CASES)
    def test_every_sequence_exactly_once(self, seed, n, world_size, budget):
        """Over all ranks and micro-batches each sequence index appears exactly once."""
        plan = plan_micro_batches(ragged(random_lengths(seed, n)), world_size, budget)
        seen = sorted(i for rank in plan.ranks for mb in rank for i in mb)
        assert seen == list(range(n))

    @pytest.mark.parametrize("seed, n, world_size, budget", PLAN_CASES)
    def test_ranks_run_the_same_number_of_micro_batches(self, seed, n, world_size, budget):
        """Every rank gets `num_micro_batches` micro-batches (at least one), padded with empty ones."""
        plan = plan_micro_batches(ragged(random_lengths(seed, n)), world_size, budget)
        assert plan.world_size == world_size and plan.num_micro_batches >= 1
        assert {len(rank) for rank in plan.ranks} == {plan.num_micro_batches}
        for rank in plan.ranks:  # empty micro-batches only pad the end
            sizes = [len(mb) for mb in rank]
            assert sizes == sorted(sizes, key=lambda k: k == 0)

    @pytest.mark.parametrize("seed, n, world_size, budget", PLAN_CASES)
    def test_token_budget(self, seed, n, world_size, budget):
        """A micro-batch holds at most `max_tokens` tokens unless it is one sequence longer than that."""
        seqs = ragged(random_lengths(seed, n))
        plan = plan_micro_batches(seqs, world_size, budget)
        for rank in plan.ranks:
            for mb in rank:
                tokens = sum(seqs.length(i) for i in mb)
                assert tokens <= budget or (len(mb) == 1 and tokens > budget)

    @pytest.mark.parametrize("seed, n, world_size, budget", PLAN_CASES)
    def test_balanced_by_tokens(self, seed, n, world_size, budget):
        """Ranks' token loads differ by at most the longest sequence (greedy onto the least loaded)."""
        lengths = random_lengths(seed, n)
        plan = plan_micro_batches(ragged(lengths), world_size, budget)
        loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan.ranks]
        assert max(loads) - min(loads) <= max(lengths)

    def test_equal_lengths_split_evenly(self):
        """Eight equal sequences on two ranks: four each, in micro-batches of the budget."""
        plan = plan_micro_batches(ragged([10] * 8), 2, 20)
        assert [sorted(len(mb) for mb in rank) for rank in plan.ranks] == [[2, 2], [2, 2]]

    def test_uneven_count_pads_with_an_empty_micro_batch(self):
        """Three sequences, one per micro-batch, on two ranks: the rank with one runs an empty second."""
        plan = plan_micro_batches(ragged([10, 10, 10]), 2, 10)
        assert plan.num_micro_batches == 2
        assert sorted(sum(len(mb) == 0 for mb in rank) for rank in plan.ranks) == [0, 1]

    def test_more_ranks_than_sequences(self):
        """Ranks left without a sequence still run one (empty) micro-batch."""
        plan = plan_micro_batches(ragged([5]), 3, 100)
        assert plan.num_micro_batches == 1
        assert sorted(plan.ranks) == [((),), ((),), ((0,),)]

    def test_deterministic(self):
        """The same sequences give the same plan (every rank computes it independently)."""
        seqs = ragged(random_lengths(3, 17))
        assert plan_micro_batches(seqs, 3, 90) == plan_micro_batches(seqs, 3, 90)

    def test_rejects_world_size_below_one(self):
        """world_size 0 is an InputError."""
        with pytest.raises(InputError, match="world_size"):
            plan_micro_batches(ragged([4]), 0, 10)

    def test_plan_properties(self):
        """`world_size` and `num_micro_batches` read the shape of `ranks`."""
        plan = MicroBatchPlan((((0,), ()), ((1, 2), (3,))))
        assert (plan.world_size, plan.num_micro_batches) == (2, 2)


class TestGroupAdvantages:
    def test_zero_mean_unit_std_per_group(self):
        """Each group's advantages have mean 0 and std 1 (up to eps)."""
        rewards = np.random.default_rng(0).uniform(0, 1, 5 * 8)
        adv = group_advantages(rewards, 8).reshape(5, 8)
        assert adv.dtype == np.float32
        np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-6)
        np.testing.assert_allclose(adv.std(axis=1), 1.0, atol=1e-4)

    def test_groups_are_adjacent_samples(self):
        """Rewards are prompt-major: [0, 1, 10, 11] with G=2 is two groups of (-1, +1)."""
        np.testing.assert_allclose(group_advantages(np.array([0.0, 1, 10, 11]), 2), [-1, 1, -1, 1], atol=1e-5)

    def test_equal_rewards_give_zero(self):
        """A group whose samples all scored the same carries no signal: advantage exactly 0."""
        adv = group_advantages(np.array([0.7, 0.7, 0.7, 0.0, 1.0, 0.5]), 3)
        assert (adv[:3] == 0.0).all() and np.abs(adv[3:]).max() > 1.0

    def test_unscaled_is_centred_only(self):
        """`scale=False` subtracts the group mean and nothing else."""
        np.testing.assert_allclose(group_advantages(np.array([1.0, 3, 0, 0]), 2, scale=False), [-1, 1, 0, 0])

    @pytest.mark.parametrize("rewards, group_size", [
        (np.zeros(5), 2), (np.zeros((2, 2)), 2), (np.zeros(4), 0),
    ])
    def test_rejects_bad_shapes(self, rewards, group_size):
        """Non-1-D rewards, a count not a multiple of G, and G < 1 are InputErrors."""
        with pytest.raises(InputError):
            group_advantages(rewards, group_size)


def naive_surrogate(logp, old_logp, adv, clip_low, clip_high):
    """Per token, in Python floats: (sum of -min(r A, clip(r) A), clipped count, max ratio)."""
    total, clipped, ratio_max = 0.0, 0, 0.0
    for lp, old, a in zip(logp, old_logp, adv, strict=True):
        r = math.exp(lp - old)
        r_clip = min(max(r, 1 - clip_low), 1 + clip_high)
        total += -min(r * a, r_clip * a)
        clipped += r_clip * a < r * a
        ratio_max = max(ratio_max, r)
    return total, clipped, ratio_max


class TestClippedSurrogate:
    # ratio < 1 - low, inside, > 1 + high; each with A > 0 and A < 0 (and A = 0)
    LOG_RATIOS = [-0.5, -0.3, 0.0, 0.1, 0.25, 0.6]
    ADVANTAGES = [1.3, -0.7, 0.0]

    def cases(self):
        rng = np.random.default_rng(0)
        pairs = [(d, a) for d in self.LOG_RATIOS for a in self.ADVANTAGES]
        old = rng.uniform(-6, -0.1, len(pairs))
        logp = old + np.array([d for d, _ in pairs])
        adv = np.array([a for _, a in pairs])
        return logp, old, adv

    @pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
    def test_matches_per_token_loop(self, clip_low, clip_high):
        """Loss sum, clipped-token count and max ratio equal the per-token Python formula."""
        logp, old, adv = self.cases()
        want_loss, want_clipped, want_max = naive_surrogate(logp, old, adv, clip_low, clip_high)
        t = [torch.tensor(x, dtype=torch.float64) for x in (logp, old, adv)]
        got = clipped_surrogate(*t, clip_low, clip_high)
        assert got.loss_sum.item() == pytest.approx(want_loss, rel=1e-12)
        assert int(got.clipped) == want_clipped and want_clipped > 0
        assert got.ratio_max.item() == pytest.approx(want_max, rel=1e-12)

    def test_clipped_in_both_directions(self):
        """A > 0 clips above 1 + high, A < 0 below 1 - low; the other side of each is not clipped."""
        old = torch.zeros(4)
        logp = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5]))
        adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
        per_token = [clipped_surrogate(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], 0.2, 0.2) for i in range(4)]
        assert [int(t.clipped) for t in per_token] == [1, 0, 1, 0]
        want = [-1.2, -0.5, 0.8, 1.5]  # -(1+high)A, -rA, -(1-low)A, -rA
        assert [t.loss_sum.item() for t in per_token] == pytest.approx(want, abs=1e-6)

    def test_gradient_zero_where_clipped(self):
        """d loss / d logp is -A r on unclipped tokens and 0 on clipped ones."""
        logp, old, adv = self.cases()
        lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
        o, a = torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)
        clipped_surrogate(lp, o, a, 0.2, 0.2).loss_sum.backward()
        r = np.exp(logp - old)
        r_clip = np.clip(r, 0.8, 1.2)
        active = ~(r_clip * adv < r * adv)
        np.testing.assert_allclose(lp.grad.numpy(), np.where(active, -adv * r, 0.0), rtol=1e-12)
        assert (lp.grad.numpy()[~active] == 0).all() and (~active).sum() > 0

    def test_on_policy_is_minus_mean_advantage_times_tokens(self):
        """At ratio 1 the loss sum is -sum(A) and nothing is clipped."""
        logp = torch.tensor([-1.0, -2.0, -0.5])
        got = clipped_surrogate(logp, logp.clone(), torch.tensor([0.5, -2.0, 1.0]), 0.2, 0.2)
        assert got.loss_sum.item() == pytest.approx(0.5) and int(got.clipped) == 0
        assert got.ratio_max.item() == 1.0

    def test_empty(self):
        """No tokens: loss 0, nothing clipped, ratio_max 0."""
        e = torch.zeros(0)
        got = clipped_surrogate(e, e, e, 0.2, 0.2)
        assert (got.loss_sum.item(), int(got.clipped), got.ratio_max.item()) == (0.0, 0, 0.0)


class TestTrainerConfig:
    def test_defaults_valid(self):
        """The defaults validate and are frozen."""
        cfg = TrainerConfig(model="m")
        assert (cfg.backend, cfg.zero_stage, cfg.dtype) == ("fsdp2", 3, "float32")
        with pytest.raises(AttributeError):
            cfg.lr = 1.0  # type: ignore[misc]

    @pytest.mark.parametrize("field, value", [
        ("backend", "ddp"), ("zero_stage", 0), ("zero_stage", 4), ("dtype", "float16"),
        ("lr", 0.0), ("lr", -1e-3), ("max_grad_norm", -1.0), ("weight_decay", -0.1),
        ("clip_low", 1.0), ("clip_low", -0.1), ("clip_high", -0.1), ("temperature", 0.0),
        ("micro_batch_tokens", 1),
    ])
    def test_rejects_out_of_range(self, field, value):
        """Every out-of-range field raises ConfigError."""
        with pytest.raises(ConfigError):
            TrainerConfig(model="m", **{field: value})

    @pytest.mark.parametrize("field, value", [
        ("backend", "hf"), ("backend", "deepspeed"), ("zero_stage", 1), ("dtype", "bfloat16"),
        ("max_grad_norm", 0.0), ("clip_low", 0.0), ("clip_high", 0.0), ("micro_batch_tokens", 2),
    ])
    def test_accepts_boundaries(self, field, value):
        """Edge values that are allowed (no clipping, no grad clip, a 2-token budget) validate."""
        assert getattr(TrainerConfig(model="m", **{field: value}), field) == value
