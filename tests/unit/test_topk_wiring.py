"""`rlcheck.loop.topk_wiring`: the engine's top-k dicts reach the trainer as ids, and the step's `TopK`
is assembled from both sides in sequence order; top-k off is the plain recompute."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlcheck.errors import InputError
from rlcheck.loop.topk_wiring import engine_topk, recompute
from rlcheck.trainers import Sequences, plan_micro_batches


def rollout(i: int, tokens: list[int], k: int | None):
    """A stand-in for `Rollout`: per position a dict of k ids (and the sampled token when not among them)."""
    top = None
    if k is not None:
        top = tuple({**{100 * i + 10 * t + j: -0.1 * (j + 1) for j in range(k)}, tok: -5.0}
                    for t, tok in enumerate(tokens))
    return SimpleNamespace(request_id=f"r{i}", token_ids=tuple(tokens), top_logprobs=top)


class FakeGroup:
    """Scores like a trainer would: logp -1 per token, logprob -0.5 at every asked id, own ids 7.."""

    def __init__(self):
        self.asked = None

    def logprobs(self, seqs, plan):
        return [np.full(len(r), -1.0, np.float32) for r in seqs.responses]

    def topk_logprobs(self, seqs, plan, top_k, routing=False):
        self.asked = seqs.topk_ids
        ids = seqs.topk_ids or [None] * len(seqs)
        return [(np.full(len(r), -1.0, np.float32),
                 None if at is None else np.where(at >= 0, -0.5, -np.inf).astype(np.float32),
                 np.tile(np.arange(7, 7 + top_k), (len(r), 1)) if top_k else None,
                 *((np.tile([[0, 1], [2, 3]], (len(r), 1, 1)),) if routing else ()))
                for r, at in zip(seqs.responses, ids, strict=True)]


class TestRecompute:
    def test_builds_the_step_topk(self):
        """The trainer is asked at the engine's top-k ids (sampled token dropped), and TopK rows follow the sequences."""
        rollouts = [rollout(0, [3, 4], 3), rollout(1, [5], 3)]
        seqs = Sequences.build([[1], [2]], [r.token_ids for r in rollouts])
        group = FakeGroup()
        logp, topk, routing = recompute(group, seqs, plan_micro_batches(seqs, 1, 100), rollouts, 2)
        assert [x.tolist() for x in logp] == [[-1.0, -1.0], [-1.0]]
        assert [a.shape for a in group.asked] == [(2, 2), (1, 2)]
        assert group.asked[0][1].tolist() == [10, 11] and topk.num_tokens == 3 and topk.k == 2
        assert topk.ids_rollout[2].tolist() == [100, 101]
        np.testing.assert_allclose(topk.logp_rollout[0], [-0.1, -0.2], rtol=1e-6)
        assert (topk.logp_train == -0.5).all() and topk.ids_train[0].tolist() == [7, 8]
        assert routing is None  # the rollouts carry no experts

    def test_moe_rollouts_bring_the_trainers_routing(self):
        """Rollouts with experts (an MoE engine): the trainer's routers are read in the same call
        (top-k off), and the step's Routing holds both sides, token by token in sequence order."""
        rollouts = [rollout(0, [3, 4], None), rollout(1, [5], None)]
        for r, first in zip(rollouts, (0, 4), strict=True):
            r.experts = np.tile([[first, 1], [2, 3]], (len(r.token_ids), 1, 1))
        seqs = Sequences.build([[1], [2]], [r.token_ids for r in rollouts])
        logp, topk, routing = recompute(FakeGroup(), seqs, plan_micro_batches(seqs, 1, 100), rollouts, 0)
        assert topk is None and [len(x) for x in logp] == [2, 1]
        assert routing.num_tokens == 3 and routing.num_layers == 2
        assert routing.experts_rollout[:, 0, 0].tolist() == [0, 0, 4] and (routing.experts_train[:, 0, 0] == 0).all()

    def test_off_is_the_plain_recompute(self):
        """top_k 0: `group.logprobs`, no TopK, the rollouts' dicts are not read."""
        rollouts = [rollout(0, [3], None)]
        seqs = Sequences.build([[1]], [[3]])
        logp, topk, routing = recompute(FakeGroup(), seqs, plan_micro_batches(seqs, 1, 100), rollouts, 0)
        assert topk is None and routing is None and logp[0].tolist() == [-1.0]

    def test_engine_without_topk_is_refused(self):
        """A rollout without top-k dicts names the VLLMConfig setting that gives them."""
        with pytest.raises(InputError, match="top_logprobs=20"):
            engine_topk([rollout(0, [3], None)], 20)

    def test_sequences_check_the_ids(self):
        """Sequences refuse top-k ids whose rows do not match the response lengths."""
        with pytest.raises(InputError, match="topk_ids"):
            Sequences(((1,),), ((3, 4),), topk_ids=(np.zeros((1, 2), np.int64),))
