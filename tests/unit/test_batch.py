"""Tests of rlcheck.core.batch.StepBatch: the three constructors agree, and bad input is named."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.errors import InputError, RLCheckError

try:  # imported here, not per test, so that no single test pays the import
    import torch
except ImportError:  # pragma: no cover
    torch = None

# Four sequences: an interior mask hole, a plain one, an empty one, and one with a hole again.
# Values are exact in bfloat16, so the torch bf16 inputs carry the same numbers.
ROLLOUT = [[-0.5, -1.0, -2.0, -0.25], [-1.5, -0.75], [], [-3.0, -0.125, -1.25]]
TRAIN = [[-0.5, -1.5, -2.0, -0.375], [-1.0, -0.75], [], [-2.0, -0.125, -4.0]]
MASK = [[1, 0, 1, 1], [1, 1], [], [1, 0, 1]]
TOKENS = [[11, 12, 13, 14], [21, 22], [], [41, 42, 43]]
IDS = ["a", "b", "c", "d"]
CU = [0, 4, 6, 6, 9]


def _packed(rows):
    return np.array([v for row in rows for v in row])


def _ragged(rows, dtype) -> list[np.ndarray]:
    """One typed array per sequence (a bare `[]` would read as float64; see test_plain_empty_lists)."""
    return [np.array(row, dtype=dtype) for row in rows]


def _padded(rows, width: int = 6, left: bool = False, fill: float = 0.0) -> np.ndarray:
    out = np.full((len(rows), width), fill)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, width - len(row) :] = row
            else:
                out[i, : len(row)] = row
    return out


def _padded_inputs(left: bool):
    """[B, T] arrays of the reference data; padding holds garbage (positive logprobs, token -1)."""
    return dict(
        logp_rollout=_padded(ROLLOUT, left=left, fill=7.0),
        logp_train=_padded(TRAIN, left=left, fill=9.0),
        mask=_padded(MASK, left=left).astype(np.int64),
        tokens=_padded(TOKENS, left=left, fill=-1).astype(np.int64),
    )


def _assert_reference(batch: StepBatch, dtype=np.float64) -> None:
    """`batch` holds exactly the reference data."""
    assert batch.request_ids == tuple(IDS)
    assert batch.num_sequences == 4 and batch.num_tokens == 9
    assert batch.cu_seqlens.dtype == np.int64
    np.testing.assert_array_equal(batch.cu_seqlens, CU)
    np.testing.assert_array_equal(batch.seq_lens, [4, 2, 0, 3])
    assert batch.logp_rollout.dtype == dtype and batch.logp_train.dtype == dtype
    np.testing.assert_array_equal(batch.logp_rollout, _packed(ROLLOUT))
    np.testing.assert_array_equal(batch.logp_train, _packed(TRAIN))
    assert batch.mask is not None and batch.mask.dtype == bool
    np.testing.assert_array_equal(batch.mask, _packed(MASK).astype(bool))
    if batch.tokens is not None:
        assert batch.tokens.dtype == np.int64
        np.testing.assert_array_equal(batch.tokens, _packed(TOKENS))


def _expect_error(fn, *words: str) -> InputError:
    """`fn()` raises an InputError (an RLCheckError) whose message holds every word in `words`."""
    with pytest.raises(InputError) as info:
        fn()
    assert isinstance(info.value, RLCheckError) and isinstance(info.value, ValueError)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    return info.value


def _simple(lr=(-1.0, -2.0, -0.5), lt=(-1.0, -2.5, -0.5), cu=(0, 2, 3), ids=("x", "y"), **kw) -> StepBatch:
    return StepBatch.from_packed(np.array(lr), np.array(lt), np.array(cu), list(ids), **kw)


class TestConstructorsAgree:
    def test_from_packed(self):
        """from_packed stores the packed arrays as given, mask and tokens included."""
        batch = StepBatch.from_packed(
            _packed(ROLLOUT), _packed(TRAIN), np.array(CU), IDS, mask=_packed(MASK), tokens=_packed(TOKENS)
        )
        _assert_reference(batch)

    def test_from_ragged(self):
        """from_ragged concatenates per-sequence lists, including an empty sequence and mask holes."""
        batch = StepBatch.from_ragged(
            ROLLOUT, TRAIN, IDS, _ragged(TOKENS, np.int64), mask=_ragged(MASK, np.int8)
        )
        _assert_reference(batch)

    def test_plain_empty_lists(self):
        """Plain Python lists, `[]` for the empty sequence, are accepted for mask and tokens."""
        batch = StepBatch.from_ragged(ROLLOUT, TRAIN, IDS, TOKENS, mask=MASK)
        _assert_reference(batch)

    @pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
    def test_from_padded(self, left):
        """from_padded keeps first..last masked-in token of each row; a row with none becomes empty."""
        batch = StepBatch.from_padded(**_padded_inputs(left), request_ids=IDS)
        _assert_reference(batch)

    def test_padded_interior_hole_keeps_position(self):
        """A masked-out token inside the response stays in the sequence, so later positions do not move."""
        batch = StepBatch.from_padded(**_padded_inputs(left=False), request_ids=IDS)
        assert batch.logp_rollout[1] == -1.0 and not batch.mask[1]

    def test_mixed_padding_rows(self):
        """Rows padded on different sides in one batch unpack to the same sequences."""
        right, left = _padded_inputs(left=False), _padded_inputs(left=True)
        mixed = {k: np.where(np.arange(4)[:, None] % 2 == 0, right[k], left[k]) for k in right}
        _assert_reference(StepBatch.from_padded(**mixed, request_ids=IDS))

    def test_all_three_agree(self):
        """The three constructors build identical batches from the same data."""
        batches = [
            StepBatch.from_packed(
                _packed(ROLLOUT), _packed(TRAIN), CU, IDS, mask=_packed(MASK), tokens=_packed(TOKENS)
            ),
            StepBatch.from_ragged(ROLLOUT, TRAIN, IDS, _ragged(TOKENS, np.int64), mask=_ragged(MASK, bool)),
            StepBatch.from_padded(**_padded_inputs(left=True), request_ids=IDS),
        ]
        for b in batches[1:]:
            for name in ("logp_rollout", "logp_train", "cu_seqlens", "mask", "tokens"):
                np.testing.assert_array_equal(getattr(b, name), getattr(batches[0], name), err_msg=name)
            assert b.request_ids == batches[0].request_ids

    def test_ragged_without_mask(self):
        """Without a mask, from_ragged leaves `mask` as None (every token counts)."""
        batch = StepBatch.from_ragged(ROLLOUT, TRAIN, IDS)
        assert batch.mask is None and batch.tokens is None
        np.testing.assert_array_equal(batch.cu_seqlens, CU)

    @pytest.mark.parametrize("dtype", [np.float32, np.float16])
    def test_narrow_floats_become_float32(self, dtype):
        """float32 input stays float32 (no silent float64 copy); float16 is widened to float32."""
        batch = StepBatch.from_packed(
            _packed(ROLLOUT).astype(dtype), _packed(TRAIN).astype(dtype), CU, IDS, mask=_packed(MASK)
        )
        _assert_reference(batch, dtype=np.float32)

    @pytest.mark.parametrize("int_dtype", [np.int32, np.uint32, np.int64])
    def test_cu_seqlens_always_int64(self, int_dtype):
        """cu_seqlens of any integer dtype is stored as int64."""
        batch = StepBatch.from_packed(_packed(ROLLOUT), _packed(TRAIN), np.array(CU, dtype=int_dtype), IDS)
        assert batch.cu_seqlens.dtype == np.int64
        np.testing.assert_array_equal(batch.cu_seqlens, CU)

    def test_nan_and_neg_inf_accepted(self):
        """NaN and -inf logprobs pass validation (stats count them; they are not an input error)."""
        batch = _simple(lr=(-1.0, -np.inf, np.nan), lt=(np.nan, -1.0, -np.inf))
        assert np.isnan(batch.logp_rollout[2]) and np.isneginf(batch.logp_rollout[1])

    def test_tiny_positive_accepted(self):
        """A logprob a hair above zero (bf16 log-softmax rounding, <= 1e-3) is accepted."""
        batch = _simple(lr=(1e-5, -2.0, -0.5), lt=(-1.0, 1e-3, -0.5))
        assert batch.logp_rollout[0] == 1e-5

    def test_int_request_ids_become_strings(self):
        """Integer request ids are stored as strings."""
        assert _simple(ids=(7, np.int64(8))).request_ids == ("7", "8")

    def test_meta_and_prompt_tokens(self):
        """Per-sequence meta columns and prompt tokens are kept, prompt tokens as int64 arrays."""
        batch = _simple(meta={"engine": [0, 1]}, prompt_tokens=[[1, 2], np.array([3], dtype=np.int32)])
        assert list(batch.meta["engine"]) == [0, 1]
        assert all(p.dtype == np.int64 for p in batch.prompt_tokens)
        np.testing.assert_array_equal(batch.prompt_tokens[0], [1, 2])


@pytest.mark.skipif(torch is None, reason="torch is not installed")
class TestTorchInputs:
    @pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
    def test_packed_tensors(self, name):
        """Packed torch tensors are read on CPU; bf16/fp16 become float32, int32 offsets int64."""
        dtype = getattr(torch, name)
        batch = StepBatch.from_packed(
            torch.tensor(_packed(ROLLOUT), dtype=dtype),
            torch.tensor(_packed(TRAIN), dtype=dtype),
            torch.tensor(CU, dtype=torch.int32),
            IDS,
            mask=torch.tensor(_packed(MASK), dtype=torch.bool),
            tokens=torch.tensor(_packed(TOKENS), dtype=torch.int32),
        )
        _assert_reference(batch, dtype=np.float32)

    @pytest.mark.parametrize("name", ["float32", "bfloat16"])
    def test_padded_tensors(self, name):
        """[B, T] torch tensors with an int mask build the same batch as numpy."""
        dtype = getattr(torch, name)
        inputs = _padded_inputs(left=True)
        batch = StepBatch.from_padded(
            torch.tensor(inputs["logp_rollout"], dtype=dtype),
            torch.tensor(inputs["logp_train"], dtype=dtype),
            torch.tensor(inputs["mask"]),
            IDS,
            tokens=torch.tensor(inputs["tokens"]),
        )
        _assert_reference(batch, dtype=np.float32)

    def test_ragged_tensors(self):
        """A list of per-sequence bf16 tensors builds a float32 batch."""
        batch = StepBatch.from_ragged(
            [torch.tensor(r, dtype=torch.bfloat16) for r in ROLLOUT],
            [torch.tensor(t, dtype=torch.bfloat16) for t in TRAIN],
            IDS,
            [torch.tensor(t, dtype=torch.int64) for t in TOKENS],
            mask=[torch.tensor(m, dtype=torch.bool) for m in MASK],
        )
        _assert_reference(batch, dtype=np.float32)

    def test_tensor_with_grad(self):
        """A tensor that requires grad is detached, not rejected."""
        lr = torch.tensor(_packed(ROLLOUT), dtype=torch.float32, requires_grad=True)
        lt = torch.tensor(_packed(TRAIN), dtype=torch.float32)
        batch = StepBatch.from_packed(lr, lt, CU, IDS, mask=_packed(MASK))
        _assert_reference(batch, dtype=np.float32)


class TestValidation:
    def test_ragged_length_mismatch(self):
        """A sequence with different rollout and train lengths is named by index."""
        _expect_error(
            lambda: StepBatch.from_ragged([[-1.0, -1.0], [-1.0]], [[-1.0, -1.0], [-1.0, -1.0]], ["a", "b"]),
            "sequence 1",
        )

    def test_ragged_sequence_count_mismatch(self):
        """Different numbers of rollout and train sequences are rejected."""
        _expect_error(lambda: StepBatch.from_ragged([[-1.0], [-1.0]], [[-1.0]], ["a", "b"]), "logp_train")

    def test_packed_length_mismatch(self):
        """Packed rollout and train arrays of different lengths are rejected."""
        _expect_error(lambda: _simple(lt=(-1.0, -2.0, -0.5, -0.5)), "tokens", "logp_train")

    @pytest.mark.parametrize("ids", [("x",), ("x", "y", "z")])
    def test_wrong_number_of_ids(self, ids):
        """The number of request ids must equal the number of sequences."""
        _expect_error(lambda: _simple(ids=ids), f"{len(ids)} ids for 2 sequences")

    def test_wrong_number_of_ids_ragged(self):
        """from_ragged checks the id count as well."""
        _expect_error(lambda: StepBatch.from_ragged(ROLLOUT, TRAIN, IDS[:3]), "ids for 4 sequences")

    def test_duplicate_id(self):
        """A repeated request id is rejected, and the message names it."""
        _expect_error(lambda: _simple(ids=("dup-7", "dup-7")), "'dup-7'", "more than once")

    @pytest.mark.parametrize("bad", [None, ""])
    def test_missing_id(self, bad):
        """A None or empty request id is rejected with its index."""
        _expect_error(lambda: _simple(ids=("x", bad)), "request_ids[1]", "missing")

    def test_non_string_id(self):
        """A request id that is neither string nor integer is rejected."""
        _expect_error(lambda: _simple(ids=("x", 1.5)), "request_ids[1]", "string")

    def test_request_ids_none(self):
        """request_ids=None is rejected with a hint to pass the engine's ids."""
        _expect_error(
            lambda: StepBatch.from_packed(np.array([-1.0]), np.array([-1.0]), [0, 1], None), "required"
        )

    def test_ids_as_single_string(self):
        """A single string is not taken as a sequence of one-character ids."""
        _expect_error(
            lambda: StepBatch.from_packed(np.array([-1.0, -2.0]), np.array([-1.0, -2.0]), [0, 1, 2], "xy"),
            "single string",
        )

    def test_empty_batch_packed(self):
        """from_packed with zero sequences is rejected."""
        _expect_error(
            lambda: StepBatch.from_packed(np.zeros(0), np.zeros(0), np.array([0]), []), "empty batch"
        )

    def test_empty_batch_ragged(self):
        """from_ragged with zero sequences is rejected."""
        _expect_error(lambda: StepBatch.from_ragged([], [], []), "empty batch")

    def test_empty_batch_padded(self):
        """from_padded with zero rows is rejected."""
        z = np.zeros((0, 5))
        _expect_error(lambda: StepBatch.from_padded(z, z.copy(), z.astype(bool), []), "empty batch")

    def test_every_token_masked(self):
        """A mask that excludes every token is a valid batch (the Monitor logs the step as empty)."""
        assert not _simple(mask=np.zeros(3, dtype=bool)).mask.any()

    def test_every_token_masked_ragged(self):
        """from_ragged with all-zero masks keeps the sequences, every token masked."""
        b = StepBatch.from_ragged([[-1.0], [-2.0]], [[-1.0], [-2.0]], ["a", "b"], mask=[[0], [0]])
        assert b.num_sequences == 2 and not b.mask.any()

    def test_every_row_masked_padded(self):
        """from_padded with an all-zero mask (TRL's mask_truncated_completions) gives empty sequences."""
        z = -np.ones((2, 3))
        b = StepBatch.from_padded(z, z.copy(), np.zeros((2, 3), dtype=bool), ["a", "b"])
        assert (b.num_sequences, b.num_tokens) == (2, 0)

    def test_every_sequence_empty(self):
        """Sequences that are all zero-length make a batch of no token."""
        assert StepBatch.from_packed(np.zeros(0), np.zeros(0), [0, 0, 0], ["a", "b"]).num_tokens == 0
        assert StepBatch.from_ragged([[], []], [[], []], ["a", "b"]).seq_lens.tolist() == [0, 0]

    @pytest.mark.parametrize("side", ["lr", "lt"])
    @pytest.mark.parametrize("value", [0.5, 2e-3, np.inf])
    def test_positive_logprob(self, side, value):
        """A logprob above 1e-3 (a logit or probability passed) or +inf is rejected, naming the request."""
        vals = {"lr": [-1.0, -2.0, -0.5], "lt": [-1.0, -2.5, -0.5]}
        vals[side][2] = value
        name = {"lr": "logp_rollout", "lt": "logp_train"}[side]
        _expect_error(lambda: _simple(**vals), name, "'y'", "sequence 1")

    def test_positive_logprob_next_to_nan(self):
        """A positive logprob is found even when a NaN hides it from max()."""
        _expect_error(lambda: _simple(lr=(np.nan, -2.0, 0.7)), "logp_rollout", "'y'")

    @pytest.mark.parametrize("dtype", [np.int64, np.int32, bool])
    def test_non_float_logprobs(self, dtype):
        """Integer or boolean logprobs are rejected (floating point required)."""
        lr = np.array([-1, -2, 0]).astype(dtype)
        _expect_error(lambda: _simple(lr=lr), "logp_rollout", "floating")

    def test_non_float_logprobs_train(self):
        """Integer train logprobs are rejected as well."""
        _expect_error(lambda: _simple(lt=np.array([-1, -2, 0])), "logp_train", "floating")

    def test_cu_seqlens_not_starting_at_zero(self):
        """Offsets must start at 0."""
        _expect_error(lambda: _simple(cu=(1, 2, 3)), "start at 0")

    def test_cu_seqlens_not_ending_at_m(self):
        """Offsets must end at the token count."""
        _expect_error(lambda: _simple(cu=(0, 1, 2)), "end at the token count 3")

    def test_cu_seqlens_decreasing(self):
        """Offsets must be non-decreasing, and the message names the sequence."""
        _expect_error(lambda: _simple(cu=(0, 2, 1, 3), ids=("x", "y", "z")), "decreases at sequence 1")

    def test_cu_seqlens_float(self):
        """Float offsets are rejected."""
        _expect_error(lambda: _simple(cu=np.array([0.0, 2.0, 3.0])), "cu_seqlens", "integer")

    def test_cu_seqlens_2d(self):
        """Offsets must be a 1-D array."""
        _expect_error(lambda: _simple(cu=np.array([[0, 2, 3]])), "cu_seqlens", "1-D")

    @pytest.mark.parametrize("mask", [[1, 2, 1], [1, -1, 1]])
    def test_mask_not_zero_one(self, mask):
        """An integer mask with values other than 0/1 is rejected."""
        _expect_error(lambda: _simple(mask=np.array(mask)), "mask", "0/1")

    def test_mask_float(self):
        """A fractional mask is rejected."""
        _expect_error(lambda: _simple(mask=np.array([1.0, 0.5, 1.0])), "mask", "boolean")

    def test_mask_wrong_length(self):
        """A mask of the wrong length is rejected."""
        _expect_error(lambda: _simple(mask=np.ones(2, dtype=bool)), "mask has shape")

    @pytest.mark.parametrize("field", ["tokens", "tokens_train"])
    def test_tokens_wrong_length(self, field):
        """Token ids of the wrong length are rejected."""
        _expect_error(lambda: _simple(**{field: np.arange(4)}), f"{field} has shape")

    def test_tokens_wrong_length_ragged(self):
        """In from_ragged, the sequence whose token count is off is named."""
        tokens = _ragged([[1, 2, 3, 4], [1], [], [1, 2, 3]], np.int64)
        _expect_error(lambda: StepBatch.from_ragged(ROLLOUT, TRAIN, IDS, tokens), "sequence 1", "tokens")

    def test_tokens_float(self):
        """Float token ids are rejected."""
        _expect_error(lambda: _simple(tokens=np.array([1.0, 2.0, 3.0])), "tokens", "integer")

    def test_meta_column_wrong_length(self):
        """A meta column must hold one entry per sequence."""
        _expect_error(
            lambda: _simple(meta={"engine": [0, 1, 2]}), "meta['engine']", "3 entries for 2 sequences"
        )

    def test_prompt_tokens_wrong_count(self):
        """prompt_tokens must hold one entry per sequence."""
        _expect_error(lambda: _simple(prompt_tokens=[[1]]), "prompt_tokens")

    @pytest.mark.parametrize("name", ["logp_train", "mask", "tokens"])
    def test_padded_shape_mismatch(self, name):
        """Every [B, T] input of from_padded must have the shape of logp_rollout."""
        inputs = _padded_inputs(left=False)
        inputs[name] = inputs[name][:, :-1]
        _expect_error(lambda: StepBatch.from_padded(**inputs, request_ids=IDS), f"{name} has shape")

    def test_padded_one_dimensional(self):
        """1-D input to from_padded is rejected with a pointer to [B, T]."""
        x = np.array([-1.0, -2.0])
        _expect_error(lambda: StepBatch.from_padded(x, x.copy(), np.ones(2, dtype=bool), ["a"]), "[B, T]")

    def test_ragged_rejects_packed_array(self):
        """from_ragged given one packed array (not a list per sequence) points to the right constructor."""
        x = np.array([-1.0, -2.0])
        _expect_error(lambda: StepBatch.from_ragged(x, x, ["a", "b"]), "from_packed")


class TestSelect:
    def _batch(self) -> StepBatch:
        tokens = _ragged(TOKENS, np.int64)
        return StepBatch.from_ragged(
            ROLLOUT,
            TRAIN,
            IDS,
            tokens,
            mask=_ragged(MASK, bool),
            tokens_train=[t + 1 for t in tokens],
            prompt_tokens=[[1], [2], [3], [4]],
            meta={"slot": [10, 11, 12, 13]},
        )

    def test_order_and_content(self):
        """select() returns the given sequences in the given order with their tokens, mask and ids."""
        sub = self._batch().select([3, 0, 2])
        assert sub.request_ids == ("d", "a", "c")
        np.testing.assert_array_equal(sub.cu_seqlens, [0, 3, 7, 7])
        assert sub.cu_seqlens.dtype == np.int64
        np.testing.assert_array_equal(sub.logp_rollout, ROLLOUT[3] + ROLLOUT[0])
        np.testing.assert_array_equal(sub.logp_train, TRAIN[3] + TRAIN[0])
        np.testing.assert_array_equal(sub.mask, np.array(MASK[3] + MASK[0], dtype=bool))
        np.testing.assert_array_equal(sub.tokens, TOKENS[3] + TOKENS[0])
        np.testing.assert_array_equal(sub.tokens_train, np.array(TOKENS[3] + TOKENS[0]) + 1)
        assert [int(p[0]) for p in sub.prompt_tokens] == [4, 1, 3]
        assert list(sub.meta["slot"]) == [13, 10, 12]

    def test_numpy_indices_and_repeat(self):
        """select() accepts a numpy index array; selecting everything round-trips."""
        batch = self._batch()
        sub = batch.select(np.arange(4))
        for name in ("logp_rollout", "logp_train", "cu_seqlens", "mask", "tokens", "tokens_train"):
            np.testing.assert_array_equal(getattr(sub, name), getattr(batch, name), err_msg=name)
        assert sub.request_ids == batch.request_ids

    def test_select_one_sequence(self):
        """A single sequence selected in the middle of the batch keeps its own values."""
        sub = self._batch().select([1])
        np.testing.assert_array_equal(sub.cu_seqlens, [0, 2])
        np.testing.assert_array_equal(sub.logp_train, TRAIN[1])

    def test_select_validates(self):
        """A selection of no sequence is rejected like any other batch; one of an empty sequence is kept."""
        _expect_error(lambda: self._batch().select([]), "empty batch")
        assert self._batch().select([2]).num_tokens == 0


def test_from_padded_needs_no_torch_for_host_arrays():
    """Numpy [B, T] arrays go the numpy way without importing torch (an install without it works)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
            "import numpy as np\nfrom rlcheck.core.batch import StepBatch\nfrom rlcheck.core.stats import compute\n"
            "lp = -np.ones((2, 3), np.float32); mask = np.array([[1, 1, 0], [0, 1, 1]], bool)\n"
            "b = StepBatch.from_padded(lp, lp.copy(), mask, request_ids=['a', 'b'])\n"
            "assert b.num_tokens == 4 and b.device_tensors is None\n"
            "compute(b)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
