"""Turns in the data model (`rlcheck.core.turns`, `rlcheck.core.turns_build`): each token's model turn and
the tool tokens, built per turn, from mask runs, from a turn index or spans, on numpy and torch inputs."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.turns import JoinEdits, TurnRecord, Turns
from rlcheck.core.turns_build import Trajectory, Turn
from rlcheck.errors import InputError


def two_turns(lp1=(-1.0, -2.0), tool=(7, 7), join=None, out0=(1, 2, 3)) -> StepBatch:
    """Two trajectories: one of two turns with a tool reply between them, one of a single turn."""
    out0 = list(out0)
    p1 = [9, 9, *out0, *tool]
    t0 = Turn(out0, [-0.1, -0.2, -0.3][:len(out0)], prompt_ids=[9, 9], observation_ids=list(tool), version=3)
    t1 = Turn([4, 5], list(lp1), prompt_ids=p1, version=4)
    kept = len(out0) - (1 if join is not None and out0[-1] in join.remove_trailing else 0)
    n0 = kept + len(tool) + 2
    return StepBatch.from_turns([Trajectory([t0, t1], logp_train=np.full(n0, -0.5), num_turns=2),
                                 Trajectory([Turn([1], [-0.1], prompt_ids=[8])], logp_train=[-0.2])], ["a", "b"], join=join)


class TestFromTurns:
    def test_layout_mask_and_logprobs(self):
        """Each turn's output, then its observation: engine logprobs on outputs, 0.0 and mask 0 on tool tokens."""
        b = two_turns()
        np.testing.assert_array_equal(b.tokens, [1, 2, 3, 7, 7, 4, 5, 1])
        np.testing.assert_array_equal(b.mask, [1, 1, 1, 0, 0, 1, 1, 1])
        np.testing.assert_allclose(b.logp_rollout, [-0.1, -0.2, -0.3, 0, 0, -1, -2, -0.1])
        np.testing.assert_array_equal(b.turns.index, [0, 0, 0, 0, 0, 1, 1, 0])
        np.testing.assert_array_equal(b.turns.tool, [0, 0, 0, 1, 1, 0, 0, 0])
        assert b.turns.source == "explicit"
        np.testing.assert_array_equal(b.prompt_tokens[0], [9, 9])

    def test_records(self):
        """The engine's per-call prompts, outputs, logprob counts, versions and the framework's turn count."""
        r = two_turns().turns.records[0]
        assert r.num_calls == 2 and r.logprob_counts == (2 + 1, 2) and r.versions == (3, 4) and r.num_turns == 2
        np.testing.assert_array_equal(r.prompt_ids[1], [9, 9, 1, 2, 3, 7, 7])

    def test_short_logprobs_are_masked_and_counted(self):
        """A turn with fewer logprobs than tokens: the count is kept, the unscored tokens masked out."""
        b = two_turns(lp1=(-1.0,))
        assert b.turns.records[0].logprob_counts == (3, 1)
        np.testing.assert_array_equal(b.mask[:7], [1, 1, 1, 0, 0, 1, 0])
        assert b.logp_rollout[6] == 0.0

    def test_declared_removal_drops_the_sampled_stop(self):
        """JoinEdits.remove_trailing: the sampled stop id and its logprob leave the trained stream."""
        b = two_turns(join=JoinEdits(remove_trailing=(3,)))
        np.testing.assert_array_equal(b.tokens, [1, 2, 7, 7, 4, 5, 1])
        assert b.turns.join.remove_trailing == (3,)
        assert b.turns.records[0].logprob_counts == (3, 2)

    def test_wrong_train_length_names_the_layout(self):
        with pytest.raises(InputError, match="laid out turn by turn"):
            StepBatch.from_turns([Trajectory([Turn([1, 2], [-0.1, -0.1], observation_ids=[5])], logp_train=[-0.1, -0.1])],
                                 ["a"])

    def test_needs_turns(self):
        with pytest.raises(InputError, match="at least one Turn"):
            StepBatch.from_turns([Trajectory([], logp_train=[])], ["a"])


class TestJoinEdits:
    def test_insert_and_remove(self):
        j = JoinEdits(remove_trailing=(5,), insert_after=((9, (10,)),))
        np.testing.assert_array_equal(j.edit([1, 5]), [1])
        np.testing.assert_array_equal(j.edit([1, 9]), [1, 9, 10])
        np.testing.assert_array_equal(j.edit([1, 2]), [1, 2])


class TestFromMask:
    def test_runs_are_turns(self):
        """Runs of 1 in the mask are turns 0, 1, ...; masked tokens are tool tokens holding the turn they follow."""
        t = Turns.from_mask([0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1], [0, 6, 11])
        np.testing.assert_array_equal(t.index, [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1])
        np.testing.assert_array_equal(t.tool, [1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0])
        np.testing.assert_array_equal(t.turn_counts(np.array([0, 6, 11])), [2, 2])
        assert t.source == "mask_runs"

    def test_runs_do_not_cross_sequences(self):
        """A run of 1s continuing into the next sequence starts that sequence's turn 0."""
        t = Turns.from_mask([1, 1, 1, 1], [0, 2, 2, 4])
        np.testing.assert_array_equal(t.index, [0, 0, 0, 0])
        runs = t.runs(np.array([0, 2, 2, 4]))
        np.testing.assert_array_equal(runs.seq, [0, 2])
        np.testing.assert_array_equal(runs.last, [True, True])

    def test_offsets(self):
        t = Turns.from_mask([1, 1, 1, 0, 0, 1, 1], [0, 7])
        np.testing.assert_array_equal(t.offsets(np.array([0, 7])), [0, 1, 2, 0, 1, 0, 1])


class TestFromIndex:
    def test_negative_is_tool(self):
        t = Turns.from_index(np.array([-1, 0, 0, -1, 1, -1]), [0, 6])
        np.testing.assert_array_equal(t.index, [0, 0, 0, 0, 1, 1])
        np.testing.assert_array_equal(t.tool, [1, 0, 0, 1, 0, 1])

    @pytest.mark.parametrize("index", [[0, 1, -1, 1], [1, 1], [0, 2], [0, -1, 0]])
    def test_bad_numbering_is_refused(self, index):
        """A turn split in two runs, a sequence not starting at turn 0, a turn skipped: InputError."""
        with pytest.raises(InputError, match="numbered 0, 1"):
            Turns.from_index(np.array(index), [0, len(index)])

    def test_spans(self):
        """OpenRLHF-style action ranges: explicit [start, end) spans per sequence."""
        t = Turns.from_spans([[(0, 2), (4, 5)], [(1, 3)]], [0, 6, 9])
        np.testing.assert_array_equal(t.tool, [0, 0, 1, 1, 0, 1, 1, 0, 0])
        np.testing.assert_array_equal(t.index, [0, 0, 0, 0, 1, 1, 0, 0, 0])
        with pytest.raises(InputError, match="overlaps"):
            Turns.from_spans([[(0, 3), (2, 4)]], [0, 6])


class TestConstructors:
    def test_padded_and_packed_agree(self):
        """from_padded with a [B, T] turn index packs it as the tokens; "mask_runs" gives the same here."""
        m = np.array([[1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]])
        idx = np.array([[0, 0, -1, -1, 1, 1, -1], [-1, 0, 0, 0, -1, -1, -1]])
        lr, lt = np.full((2, 7), -0.1), np.full((2, 7), -0.2)
        a = StepBatch.from_padded(lr, lt, m, ["x", "y"], turns=idx)
        b = StepBatch.from_padded(lr, lt, m, ["x", "y"], turns="mask_runs")
        np.testing.assert_array_equal(a.turns.index, b.turns.index)
        np.testing.assert_array_equal(a.turns.tool, b.turns.tool)
        np.testing.assert_array_equal(a.turns.index, [0, 0, 0, 0, 1, 1, 0, 0, 0])

    def test_ragged_turn_index(self):
        b = StepBatch.from_ragged([np.full(3, -0.1), np.full(2, -0.1)], [np.full(3, -0.1), np.full(2, -0.1)], ["a", "b"],
                                  turns=[[0, -1, 1], [0, 0]])
        np.testing.assert_array_equal(b.turns.index, [0, 0, 1, 0, 0])

    def test_records_need_turns(self):
        with pytest.raises(InputError, match="need turns"):
            StepBatch.from_packed(np.zeros(2) - 0.1, np.zeros(2) - 0.1, [0, 2], ["a"], turn_records=[TurnRecord()])

    def test_records_one_per_sequence(self):
        with pytest.raises(InputError, match="records for 1 sequences"):
            StepBatch.from_packed(np.zeros(2) - 0.1, np.zeros(2) - 0.1, [0, 2], ["a"], turns="mask_runs",
                                  turn_records=[None, None])

    def test_turn_index_length(self):
        with pytest.raises(InputError, match="one per token"):
            StepBatch.from_packed(np.zeros(2) - 0.1, np.zeros(2) - 0.1, [0, 2], ["a"], turns=np.array([0, 0, 0]))

    def test_record_fields_agree(self):
        with pytest.raises(InputError, match="disagree"):
            TurnRecord(output_ids=[[1], [2]], versions=[1])

    def test_with_turns_from_mask(self):
        b = StepBatch.from_packed(np.zeros(5) - 0.1, np.zeros(5) - 0.1, [0, 5], ["a"], mask=[1, 0, 1, 1, 0])
        t = b.with_turns(records=[TurnRecord(num_turns=2)]).turns
        np.testing.assert_array_equal(t.index, [0, 0, 1, 1, 1])
        assert t.records[0].num_turns == 2


class TestSelectConcat:
    def test_select_keeps_turns_and_records(self):
        b = two_turns().select([1, 0])
        np.testing.assert_array_equal(b.turns.index, [0, 0, 0, 0, 0, 0, 1, 1])
        assert b.turns.records[1].versions == (3, 4) and b.turns.records[0].versions is None
        np.testing.assert_array_equal(b.prompt_tokens[0], [8])

    def test_concat_keeps_turns(self):
        """Joined turns renumber nothing (numbers are per sequence); a part without records gives None rows."""
        a = two_turns()
        other = StepBatch.from_packed(a.logp_rollout, a.logp_train, a.cu_seqlens, ["c", "d"], mask=a.mask,
                                      turns="mask_runs")
        c = StepBatch.concat([a, other])
        assert c.turns.source == "mask_runs" and c.turns.records[2:] == (None, None)
        np.testing.assert_array_equal(c.turns.index[8:], [0, 0, 0, 0, 0, 1, 1, 0])

    def test_concat_drops_turns_unless_all_have_them(self):
        a = two_turns()
        plain = StepBatch.from_packed(a.logp_rollout, a.logp_train, a.cu_seqlens, ["c", "d"])
        assert StepBatch.concat([a, plain]).turns is None


class TestDevicePath:
    @pytest.fixture
    def as_device(self, monkeypatch):
        """CPU tensors taken for device tensors: the GPU packing path, run here."""
        from rlcheck.core import batch_torch

        monkeypatch.setattr(batch_torch, "on_device", lambda x: hasattr(x, "detach"))

    def test_from_padded_on_device(self, as_device):
        """Tensors 'on a device' with a [B, T] turn tensor: same turns as numpy, device tensors kept by with_turns."""
        torch = pytest.importorskip("torch")
        m = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
        idx = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
        lr, lt = torch.full((2, 4), -0.1), torch.full((2, 4), -0.3)
        b = StepBatch.from_padded(lr, lt, m, ["x", "y"], turns=idx)
        assert b.device_tensors is not None
        np.testing.assert_array_equal(b.turns.index, [0, 0, 0, 1, 0])
        assert b.with_turns().device_tensors is b.device_tensors
