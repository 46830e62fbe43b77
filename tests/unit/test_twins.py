"""Twins (`rlcheck.core.stats.twins`): tokens scored in identical contexts within a step, and the
`split_twins` signature an engine that scores them apart raises."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import SignatureDetector
from rlcheck.core.stats import StatsConfig, compute, compute_partial, finalize, merge
from rlcheck.core.stats.twins import split_twin_sequences
from rlcheck.synthetic.groups import grpo_batch


class TestTwinStats:
    def test_a_healthy_engine_splits_nothing(self):
        """Identical contexts scored alike on both sides: twin groups counted, none split."""
        m, _ = compute(grpo_batch())
        assert m[K.SIG_TWIN_GROUPS] == 4 * 3 and m[K.SIG_TWIN_SPLIT] == 0 and K.SIG_TWIN_FIRST_POS not in m

    def test_stale_sequences_split_their_groups(self):
        """Two sequences of different prompts scored off at their first tokens split their prompts'
        groups at positions 0 and 1 (4 groups, 32 sequences in them), the spread and position named; the
        sequences named are the two the engine scored off, not their twins."""
        batch = grpo_batch(stale={1, 9})
        m, _ = compute(batch)
        assert (m[K.SIG_TWIN_SPLIT], m[K.SIG_TWIN_SPLIT_SEQS], m[K.SIG_TWIN_FIRST_POS]) == (4, 32, 0)
        assert m[K.SIG_TWIN_SPREAD] == pytest.approx(0.3, rel=1e-5) and m[K.SIG_TWIN_TRAINER_SPLIT] == 0
        assert np.flatnonzero(split_twin_sequences(batch, StatsConfig())).tolist() == [1, 9]  # the twins scored off

    def test_a_split_on_both_sides_is_not_the_engines(self):
        """When the trainer scores the same twins apart too, the split is counted as the trainer's only."""
        m, _ = compute(grpo_batch(stale={1}, trainer_stale={1}))
        assert m[K.SIG_TWIN_SPLIT] == 0 and m[K.SIG_TWIN_TRAINER_SPLIT] == 2

    def test_the_bar_is_in_residual_units(self):
        """A spread under twin_tau * (1 - p)^0.91 is no split; a lower twin_tau (a finer floor) counts it."""
        batch = grpo_batch(stale={1})
        assert compute(batch, StatsConfig(twin_tau=10.0))[0][K.SIG_TWIN_SPLIT] == 0
        assert compute(batch, StatsConfig(twin_tau=1e-4))[0][K.SIG_TWIN_SPLIT] == 2

    def test_masked_tokens_and_missing_ids(self):
        """Masked tokens are not compared; without prompt or token ids there are no twin metrics."""
        batch = grpo_batch(stale={1})
        masked = grpo_batch(stale={1}, mask=[np.arange(6) >= 2 for _ in range(32)])
        assert compute(masked)[0][K.SIG_TWIN_SPLIT] == 0 and compute(masked)[0][K.SIG_TWIN_GROUPS] == 4
        bare = StepBatch.from_packed(batch.logp_rollout, batch.logp_train, batch.cu_seqlens, batch.request_ids)
        assert K.SIG_TWIN_GROUPS not in compute(bare)[0]

    def test_merge_and_torch_agree(self):
        """Two halves merged count what the whole does (twins within a half); the torch backend agrees."""
        batch = grpo_batch(stale={1, 9, 17})
        whole, _ = compute(batch)
        halves = [batch.select(np.arange(0, 16)), batch.select(np.arange(16, 32))]
        merged, _ = finalize(merge([compute_partial(h) for h in halves]))
        keys = (K.SIG_TWIN_GROUPS, K.SIG_TWIN_SPLIT, K.SIG_TWIN_SPLIT_SEQS, K.SIG_TWIN_SPREAD, K.SIG_TWIN_FIRST_POS)
        assert [merged[k] for k in keys] == [whole[k] for k in keys]
        pytest.importorskip("torch")
        torch_m, _ = compute(batch, StatsConfig(backend="torch-eager"))
        assert [torch_m[k] for k in keys] == [whole[k] for k in keys]


class TestSplitTwinsSignature:
    def test_critical_on_a_split_step(self):
        """Two or more split groups (and 5% of them) raise a critical split_twins naming the counts."""
        m, _ = compute(grpo_batch(stale={1, 9}))
        (a,) = [a for a in SignatureDetector().update(3, m) if a.details["signature"] == "split_twins"]
        assert (a.severity, a.details["split"], a.details["groups"], a.details["first_position"]) == ("critical", 4, 12, 0)
        assert "stale state" in a.message and "index aliasing" in a.message

    def test_quiet_on_one_split_group_or_none(self):
        """One split group is below the signature's bar; a healthy step raises nothing."""
        det = SignatureDetector()
        one = compute(grpo_batch(stale={1}, mask=[np.arange(6) < 1 for _ in range(32)]))[0]  # first tokens only
        assert (one[K.SIG_TWIN_SPLIT], one[K.SIG_TWIN_GROUPS]) == (1, 4)
        assert det.update(0, one) == [] and det.update(1, compute(grpo_batch())[0]) == []

    def test_an_moe_batch_warns(self):
        """A batch carrying MoE routing (router noise reroutes near-tie tokens between batches, splitting twins
        too) gets the signature as a warning, naming the routing metrics."""
        import dataclasses

        from rlcheck.core.moe import Routing

        batch = grpo_batch(stale={1, 9})
        experts = np.zeros((batch.num_tokens, 1, 2), dtype=np.int64)
        routed = dataclasses.replace(batch, routing=Routing(experts, experts))
        m, _ = compute(routed)
        (a,) = [a for a in SignatureDetector().update(0, m) if a.details["signature"] == "split_twins"]
        assert m[K.SIG_TWIN_ROUTED] == 1.0 and a.severity == "warn" and "moe/" in a.message


class TestTwinsOff:
    """Groups both sides scored alike, off from each other together (`twin_off`), and the `twins_off` signature
    (raised on a dense model with recurrent state: `SignatureDetector.state_model`)."""

    @staticmethod
    def off(m, state_model: bool | None = True) -> list:
        """The twins_off alarms a fresh detector raises on metrics `m` for a model of that kind."""
        det = SignatureDetector()
        det.state_model = state_model
        return [a for a in det.update(1, m) if a.details["signature"] == "twins_off"]

    def test_a_prompt_off_together(self):
        """Every sample of prompt 0 scored 1 nat low by the engine on its first 2 tokens: its two shared-prefix
        groups (positions 0 and 1) are off together, not split; its 16 sequences named; the merge of two halves and
        the torch backend count the same."""
        from rlcheck.core.stats.twins import off_twin_sequences

        batch = grpo_batch(stale=range(8), offset=1.0)
        m, _ = compute(batch)
        assert (m[K.SIG_TWIN_SPLIT], m[K.SIG_TWIN_OFF], m[K.SIG_TWIN_OFF_SEQS]) == (0, 2, 16)
        assert m[K.SIG_TWIN_OFF_GAP] == pytest.approx(1.0, rel=1e-5)
        assert np.flatnonzero(off_twin_sequences(batch, StatsConfig())).tolist() == list(range(8))
        halves = [batch.select(np.arange(0, 16)), batch.select(np.arange(16, 32))]
        merged, _ = finalize(merge([compute_partial(h) for h in halves]))
        keys = (K.SIG_TWIN_OFF, K.SIG_TWIN_OFF_SEQS, K.SIG_TWIN_OFF_GAP)
        assert [merged[k] for k in keys] == [m[k] for k in keys]
        pytest.importorskip("torch")
        torch_m, _ = compute(batch, StatsConfig(backend="torch-eager"))
        assert [torch_m[k] for k in keys] == [m[k] for k in keys]

    def test_under_the_bar_split_or_healthy_is_not_off(self):
        """A gap under twin_off split bars, a group the engine split (one sample off) and a healthy step count none."""
        assert compute(grpo_batch(stale=range(8), offset=1.0), StatsConfig(twin_off=1e3))[0][K.SIG_TWIN_OFF] == 0
        assert compute(grpo_batch(stale={1}))[0][K.SIG_TWIN_OFF] == 0
        assert compute(grpo_batch())[0][K.SIG_TWIN_OFF] == 0

    def test_critical_on_a_recurrent_model_only(self):
        """On a model with recurrent state, 2 groups off of 12 halt (critical twins_off, naming the counts and the
        gap); on a model without (or of unknown type) nothing is raised: the shape was calibrated on state models."""
        m, _ = compute(grpo_batch(stale=range(8), offset=1.0))
        (a,) = self.off(m)
        assert (a.details["signature"], a.severity, a.details["groups_off"], a.details["groups"]) == ("twins_off", "critical", 2, 12)
        assert "stale state" in a.message and "1 nats" in a.message
        assert self.off(m, state_model=False) == [] and self.off(m, state_model=None) == []

    def test_a_fault_on_every_prompt_or_an_moe_batch_is_not_off(self):
        """Every prompt off together (8 of 12 groups: a weight or a temperature moves every request) is past
        twin_off_max_frac; an MoE batch (router noise) raises nothing either; one group off is under the minimum."""
        import dataclasses

        from rlcheck.core.moe import Routing

        everyone = compute(grpo_batch(stale=range(32), offset=1.0))[0]
        assert everyone[K.SIG_TWIN_OFF] == 8 and self.off(everyone) == []
        batch = grpo_batch(stale=range(8), offset=1.0)
        experts = np.zeros((batch.num_tokens, 1, 2), dtype=np.int64)
        routed = compute(dataclasses.replace(batch, routing=Routing(experts, experts)))[0]
        assert routed[K.SIG_TWIN_OFF] == 2 and self.off(routed) == []
        one = compute(grpo_batch(stale=range(8), offset=1.0, mask=[np.arange(6) < 1 for _ in range(32)]))[0]
        assert one[K.SIG_TWIN_OFF] == 1 and self.off(one) == []
