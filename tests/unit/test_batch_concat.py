"""`rlcheck.core.batch.StepBatch.concat` (and `concat_batches`): several batches (the ranks' of one step)
joined into one."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch, concat_batches
from rlcheck.errors import InputError


def whole_batch() -> StepBatch:
    """Three sequences (lengths 4, 2, 3) with every optional field: mask, tokens, prompts, meta."""
    lens = [4, 2, 3]
    rollout = [-np.arange(1, n + 1) / 10 for n in lens]
    return StepBatch.from_ragged(
        rollout, [r - 0.01 for r in rollout], ["a", "b", "c"],
        tokens=[np.arange(n) + 100 * i for i, n in enumerate(lens)],
        mask=[[True, False, True, True], [True, True], [True, True, False]],
        tokens_train=[np.arange(n) + 100 * i for i, n in enumerate(lens)],
        prompt_tokens=[[5, 6], [7, 8, 9], [4]],
        meta={"rank": [0, 1, 1], "row": [0, 0, 1]},
    )


class TestConcatBatches:
    def test_equals_one_batch_of_all_sequences(self):
        """Two parts concatenate to the batch of all their sequences, in order, every field kept."""
        whole = whole_batch()
        joined = concat_batches([whole.select([0]), whole.select([1, 2])])
        for name in ("logp_rollout", "logp_train", "cu_seqlens", "mask", "tokens", "tokens_train"):
            np.testing.assert_array_equal(getattr(joined, name), getattr(whole, name))
        assert joined.request_ids == whole.request_ids
        assert dict(joined.meta) == {k: list(v) for k, v in whole.meta.items()}
        assert [p.tolist() for p in joined.prompt_tokens] == [p.tolist() for p in whole.prompt_tokens]

    def test_drops_what_one_part_lacks(self):
        """Tokens, prompts or a meta column missing from one part are left out of the result, not
        half-filled; a part without a mask counts all its tokens."""
        whole = whole_batch()
        bare = StepBatch.from_ragged([[-1.0]], [[-1.5]], ["d"], meta={"rank": [2]})
        joined = concat_batches([whole, bare])
        assert joined.tokens is None and joined.prompt_tokens is None
        assert joined.mask.tolist() == whole.mask.tolist() + [True]
        assert dict(joined.meta) == {"rank": [0, 1, 1, 2]}
        assert joined.seq_lens.tolist() == [4, 2, 3, 1]

    def test_single_batch_is_returned_as_is(self):
        """One batch: nothing to join."""
        b = StepBatch.from_ragged([[-1.0]], [[-1.0]], ["a"])
        assert concat_batches([b]) is b

    def test_refuses_no_batch_and_repeated_ids(self):
        """No batch, or two parts that share a request id, is an InputError."""
        with pytest.raises(InputError, match="at least one"):
            concat_batches([])
        b = StepBatch.from_ragged([[-1.0]], [[-1.0]], ["a"])
        with pytest.raises(InputError, match="more than once"):
            concat_batches([b, b])


class TestStepBatchConcat:
    def test_equals_concat_batches(self):
        """The classmethod joins parts field by field as `concat_batches` does, and refuses what it refuses."""
        whole = whole_batch()
        parts = [whole.select([2]), whole.select([0, 1])]
        joined, expected = StepBatch.concat(parts), concat_batches(parts)
        for name in ("logp_rollout", "logp_train", "cu_seqlens", "mask", "tokens", "tokens_train"):
            np.testing.assert_array_equal(getattr(joined, name), getattr(expected, name))
        assert joined.request_ids == expected.request_ids == ("c", "a", "b")
        assert dict(joined.meta) == dict(expected.meta)
        assert [p.tolist() for p in joined.prompt_tokens] == [p.tolist() for p in expected.prompt_tokens]
        assert StepBatch.concat([whole]) is whole
        with pytest.raises(InputError, match="at least one"):
            StepBatch.concat([])
