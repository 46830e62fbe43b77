"""Every offset and count in rlcheck is int64: a source scan that fails on any narrow integer dtype
outside an explicit allowlist, and the offset arithmetic run with offsets past 2**32 (the uint32 wrap
the design warns of), each checked against Python-int arithmetic.

No test allocates 2**32 tokens: the pure helpers take small arrays holding large offsets, and the one
numpy reduction over a real 2**32-element array reads a sparse memory-mapped file (16 GiB apparent,
a few KiB on disk) only past the 2**32 mark.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rlcheck.core import histogram as H
from rlcheck.core.batch import StepBatch, segment_token_indices
from rlcheck.core.stats import StatsConfig, compute_partial, merge
from rlcheck.core.stats.sequences import first_in_segments, segment_max
from rlcheck.errors import InputError

RLCHECK = Path(__file__).resolve().parents[2] / "rlcheck"
BIG = 2**32  # the first offset a uint32 cannot hold

# Integer dtypes narrower than 64 bits, as numpy / torch attributes, bare names or dtype strings.
NARROW = {"int8", "int16", "int32", "uint8", "uint16", "uint32", "intc", "uintc", "short", "ushort"}
NARROW_STRING = re.compile(r"[<>=|]?(u?int(8|16|32)|[iu][124]|u?intc)")
NARROW_CASTS = {"int", "short"}  # torch: tensor.int() is int32, tensor.short() int16

# (file under rlcheck/, enclosing function, expression): the narrow dtypes that are not indices.
ALLOWED = {
    # |d| binning reads the exponent and top mantissa bits of the float32 bit pattern: a view of
    # float bits, never an offset or a count.
    ("core/histogram.py", "abs_histogram", "np.uint32"),
    ("core/stats/torch_kernels.py", "abs_histogram", "torch.int32"),  # the same bit view, in torch
    # a 0/1 response mask as bytes, for argmax (the first masked-in position; the result is int64)
    ("core/batch_torch.py", "device_padded", "torch.uint8"),
    # the collective weight sync's byte buffers: tensors viewed as bytes, offsets are Python ints
    ("engines/vllm_collective.py", "flatten", "torch.uint8"),
    ("engines/vllm_collective.py", "send_weights", "torch.uint8"),
    ("engines/vllm_collective.py", "receive_buckets", "torch.uint8"),
    ("engines/vllm_collective.py", "_broadcast_text", "torch.uint8"),
}


def narrow_int_uses(source: str) -> list[tuple[str, str, int]]:
    """(enclosing function or "<module>", expression, line) of every narrow integer dtype in `source`:
    np.int32 / torch.int32 / torch.int, a bare `int32`, a dtype string such as "int32" or "<i4", and
    the torch casts `.int()` / `.short()`. Comments and docstrings do not count."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        hit = (
            (isinstance(node, ast.Attribute) and node.attr in NARROW)
            or (isinstance(node, ast.Attribute) and node.attr == "int" and ast.unparse(node.value) == "torch")
            or (isinstance(node, ast.Name) and node.id in NARROW)
            or (isinstance(node, ast.Constant) and isinstance(node.value, str) and NARROW_STRING.fullmatch(node.value))
            or (isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute)
                and node.func.attr in NARROW_CASTS and not isinstance(node.func.value, ast.Constant))
        )
        if hit:
            found.append((func, ast.unparse(node), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), "<module>")
    return found


def _rlcheck_uses() -> list[tuple[str, str, str, int]]:
    out = []
    for path in sorted(RLCHECK.rglob("*.py")):
        rel = path.relative_to(RLCHECK).as_posix()
        out += [(rel, func, expr, line) for func, expr, line in narrow_int_uses(path.read_text())]
    return out


class TestNarrowIntScan:
    def test_rlcheck_has_no_narrow_index_dtype(self):
        """No narrow integer dtype appears in rlcheck's code outside the allowlist."""
        bad = [f"rlcheck/{rel}:{line} in {func}: {expr}" for rel, func, expr, line in _rlcheck_uses()
               if (rel, func, expr) not in ALLOWED]
        assert not bad, "offsets and counts must be int64:\n" + "\n".join(bad)

    def test_allowlist_is_not_stale(self):
        """Every allowlist entry still matches a use (remove entries whose code is gone)."""
        used = {(rel, func, expr) for rel, func, expr, _ in _rlcheck_uses()}
        assert ALLOWED <= used, ALLOWED - used

    @pytest.mark.parametrize(
        "snippet",
        [
            "cu = np.zeros(3, dtype=np.int32)",
            "cu = torch.zeros(3, dtype=torch.int32)",
            "cu = torch.zeros(3, dtype=torch.int)",
            "bits = x.view(np.uint32)",
            "cu = np.asarray(x, dtype='int32')",
            "cu = x.astype('<i4')",
            "cu = x.astype(np.intc)",
            "from numpy import int32\ncu = x.astype(int32)",
            "cu = lens.cumsum(0).int()",
            "idx = pos.astype(np.int16)",
        ],
    )
    def test_catches(self, snippet):
        """A snippet holding a narrow integer dtype is reported, so the scan can fail the suite."""
        assert narrow_int_uses(f"def f(x, lens, pos):\n    {snippet.replace(chr(10), chr(10) + '    ')}\n")

    def test_catches_a_regression_in_batch(self):
        """batch_build.py with its int64 offset conversion turned into int32 is reported, in that function."""
        source = (RLCHECK / "core" / "batch_build.py").read_text()
        narrowed = source.replace("a.astype(np.int64, copy=False)", "a.astype(np.int32, copy=False)")
        assert narrowed != source
        assert ("int_array", "np.int32") in {(f, e) for f, e, _ in narrow_int_uses(narrowed)}

    def test_ignores_prose_and_wide_types(self):
        """Docstrings, comments, int64 and int() conversions are not reported."""
        src = '"""cu_seqlens are int64, never int32."""\n# np.int32 here would wrap\n' \
              "a = np.zeros(3, dtype=np.int64)\nb = int(a[0])\nc = torch.long\nd = x.view(np.float32)\n"
        assert narrow_int_uses(src) == []

    def test_reports_function_and_line(self):
        """A use is named by its enclosing function, its expression and its line."""
        assert narrow_int_uses("import numpy as np\ndef g():\n    return np.uint32\n") == [("g", "np.uint32", 3)]


class TestSegmentTokenIndices:
    def test_offsets_past_2_32(self):
        """Token indices of segments starting past 2**32 equal the Python-int ranges."""
        starts, lens = [BIG - 2, 3 * BIG + 7, 5, 2**40], [4, 2, 0, 3]
        got = segment_token_indices(np.array(starts, dtype=np.int64), np.array(lens, dtype=np.int64))
        assert got.dtype == np.int64
        assert got.tolist() == [s + i for s, n in zip(starts, lens, strict=True) for i in range(n)]

    def test_narrow_inputs_widen(self):
        """int32 / uint32 starts and lengths give int64 indices."""
        got = segment_token_indices(np.array([7, 0], np.uint32), np.array([2, 1], np.int32))
        assert got.dtype == np.int64 and got.tolist() == [7, 8, 0]


class TestFirstInSegments:
    def test_offsets_past_2_32(self):
        """Flagged tokens past 2**32 map to their sequences and in-sequence positions exactly."""
        cu = np.array([0, 2 * BIG, 2 * BIG, 2 * BIG + 10, 3 * BIG], dtype=np.int64)  # sequence 1 is empty
        pos = np.array([2 * BIG + 3, 2 * BIG + 4, 2 * BIG + 12, 3 * BIG - 1], dtype=np.int64)
        seqs, first = first_in_segments(pos, cu)
        assert seqs.tolist() == [2, 3] and first.tolist() == [3, 2]
        assert first.dtype == np.int64


class TestSegmentMax:
    def test_reduceat_past_2_32(self, tmp_path):
        """np.maximum.reduceat over a real array of 2**32 + 16 tokens, read only past 2**32 (sparse file)."""
        path = tmp_path / "x.f32"
        x = np.memmap(path, dtype=np.float32, mode="w+", shape=(BIG + 16,))
        if os.stat(path).st_blocks * 512 > 2**20:
            pytest.skip("this filesystem has no sparse files")
        x[BIG:] = np.arange(16, dtype=np.float32)
        cu = np.array([BIG, BIG + 3, BIG + 3, BIG + 16], dtype=np.int64)
        np.testing.assert_array_equal(segment_max(x, cu), [2.0, 0.0, 15.0])
        del x


class TestPositionHistogram:
    @pytest.mark.parametrize("pos", [2**24 + 1, 2**25 - 1, BIG - 1, BIG, 2 * BIG + 5, 2**33 - 1, 2**40 - 1, 2**41])
    def test_large_position_lands_in_its_bin(self, pos):
        """A first-divergence position past 2**24 (float32 rounding) or 2**32 lands in the bin holding it."""
        j = int(np.flatnonzero(H.position_histogram(np.array([pos], dtype=np.int64)))[0])
        hi = H.POS_EDGES[j + 1] if j + 1 < len(H.POS_EDGES) else np.inf
        assert H.POS_EDGES[j] <= pos < hi
        assert H.position_quantile(H.position_histogram(np.array([pos])), 0.5) == int(H.POS_EDGES[j])


class TestPositionsFromCuSeqlens:
    def test_offsets_past_2_32(self):
        """Packed position ids of sequences starting past 2**32 restart at 0, in int64."""
        torch = pytest.importorskip("torch")
        from rlcheck.trainers.logprobs import _positions_from_cu_seqlens

        cu = torch.tensor([2 * BIG, 2 * BIG + 3, 2 * BIG + 3, 2 * BIG + 5])
        got = _positions_from_cu_seqlens(cu, "cpu")
        assert got.dtype == torch.int64 and got.tolist() == [[0, 1, 2, 0, 1]]

    def test_int32_cu_seqlens(self):
        """flash-attn style int32 cu_seqlens give int64 position ids."""
        torch = pytest.importorskip("torch")
        from rlcheck.trainers.logprobs import _positions_from_cu_seqlens

        got = _positions_from_cu_seqlens(torch.tensor([0, 2, 5], dtype=torch.int32), "cpu")
        assert got.dtype == torch.int64 and got.tolist() == [[0, 1, 0, 1, 2]]


class TestMergeOffsets:
    def test_offender_index_past_2_32(self):
        """Offender indices of a rank after one holding 2**33 sequences count from 2**33, unwrapped."""
        lr = np.full(3, -1.0)
        b = StepBatch.from_packed(lr, lr - [0.0, 3.0, 0.0], [0, 1, 2, 3], ["a", "b", "c"])
        p = compute_partial(b, StatsConfig())
        merged = merge([replace(p, num_sequences=2 * BIG, offenders=()), p])
        assert merged.num_sequences == 2 * BIG + 3
        assert merged.offenders[0].request_id == "b" and merged.offenders[0].index == 2 * BIG + 1


class TestStepBatchCuSeqlens:
    @pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int16])
    def test_constructors_widen(self, dtype):
        """from_packed stores narrow integer cu_seqlens as int64 (and select keeps int64)."""
        lr = np.full(5, -1.0)
        b = StepBatch.from_packed(lr, lr.clone() if hasattr(lr, "clone") else lr.copy(), np.array([0, 2, 5], dtype=dtype), ["a", "b"])
        assert b.cu_seqlens.dtype == np.int64 and b.select([1, 0]).cu_seqlens.dtype == np.int64

    def test_torch_int32_widens(self):
        """A torch int32 cu_seqlens (the flash-attn habit) is stored as int64."""
        torch = pytest.importorskip("torch")
        lr = torch.full((5,), -1.0)
        b = StepBatch.from_packed(lr, lr.clone() if hasattr(lr, "clone") else lr.copy(), torch.tensor([0, 2, 5], dtype=torch.int32), ["a", "b"])
        assert b.cu_seqlens.dtype == np.int64

    def test_dataclass_rejects_int32(self):
        """The dataclass itself, which converts nothing, rejects int32 cu_seqlens with an InputError."""
        lr = np.full(5, -1.0)
        with pytest.raises(InputError, match="cu_seqlens must be int64"):
            StepBatch(lr, lr, np.array([0, 2, 5], dtype=np.int32), ("a", "b"))

    def test_float_offsets_rejected(self):
        """Floating-point cu_seqlens are an InputError, not a silent cast."""
        lr = np.full(5, -1.0)
        with pytest.raises(InputError, match="cu_seqlens: expected integer values"):
            StepBatch.from_packed(lr, lr.clone() if hasattr(lr, "clone") else lr.copy(), np.array([0.0, 2.0, 5.0]), ["a", "b"])

    def test_uint64_past_int64_rejected(self):
        """A uint64 offset past 2**63 (negative once int64) fails validation instead of indexing."""
        lr = np.full(5, -1.0)
        with pytest.raises(InputError, match="cu_seqlens"):
            StepBatch.from_packed(lr, lr.clone() if hasattr(lr, "clone") else lr.copy(), np.array([0, 2**63 + 2, 5], dtype=np.uint64), ["a", "b"])
