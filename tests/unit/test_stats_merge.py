"""`merge` of disjoint parts gives the statistics of the whole batch (what every rank reduction relies on)."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck import StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.stats import StatsConfig, compute, compute_partial, empty_partial, finalize, merge


class TestMerge:
    @pytest.mark.parametrize("extreme", [True, False])
    @pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-9), (np.float32, 1e-5)])
    def test_two_halves_equal_whole(self, make_skewed_batch, assert_stats_equal, dtype, rtol, extreme):
        """Merging the partials of the first and second half reproduces compute() of the whole batch."""
        batch, cfg = make_skewed_batch(dtype, extreme=extreme), StatsConfig()
        half = batch.num_sequences // 2
        parts = [
            compute_partial(batch.select(np.arange(half)), cfg),
            compute_partial(batch.select(np.arange(half, batch.num_sequences)), cfg),
        ]
        merged = merge(parts)
        assert_stats_equal(finalize(merged, cfg), compute(batch, cfg), rtol)
        whole = compute_partial(batch, cfg)
        for key in whole.hists:
            np.testing.assert_array_equal(merged.hists[key], whole.hists[key])

    def test_fixture_exercises_the_hard_cases(self, make_skewed_batch):
        """The test batch holds empty, masked, clipped, non-finite and early-diverging sequences."""
        batch = make_skewed_batch()
        metrics, offenders = compute(batch)
        assert metrics["rlcheck/seq/empty_count"] == np.count_nonzero(batch.seq_lens == 0) + 1
        assert metrics["rlcheck/ratio/clipped_count"] == 1
        assert metrics["rlcheck/token/nonfinite_count"] == 1
        assert metrics["rlcheck/sig/early_div_count"] >= 1
        assert offenders[0].nonfinite and offenders[0].request_id == "req-0250"


class TestEmptyPartial:
    @pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-12), (np.float32, 1e-12)])
    def test_merging_nothing_changes_nothing(self, make_skewed_batch, assert_stats_equal, dtype, rtol):
        """A rank with no sequence contributes empty_partial: before, between or after, the result is unchanged."""
        batch, cfg = make_skewed_batch(dtype), StatsConfig(thresholds=(0.2, 3.0), top_k=4)
        whole = compute_partial(batch, cfg)
        empty = empty_partial(cfg)
        assert empty.num_sequences == 0 and empty.offenders == ()
        assert (empty.sums.keys(), empty.maxima.keys(), empty.hists.keys()) == (
            whole.sums.keys(), whole.maxima.keys(), whole.hists.keys())
        for parts in ([empty, whole], [whole, empty], [empty, whole, empty]):
            merged = merge(parts)
            assert_stats_equal(finalize(merged, cfg), finalize(whole, cfg), rtol)
            assert [o.request_id for o in merged.offenders] == [o.request_id for o in whole.offenders]


class TestMergeEdgeCases:
    def test_offender_ties_break_by_index(self):
        """Equal max |d| at the top-K edge goes to the lower index, in one process and merged alike."""
        lr = np.full(4, -1.0)
        b = StepBatch.from_packed(lr, lr + [0, 0, 0.5, 0.5], np.arange(5), list("abcd"))
        cfg = StatsConfig(top_k=1)
        whole = compute(b, cfg)[1]
        halves = finalize(merge([compute_partial(b.select([0, 1]), cfg), compute_partial(b.select([2, 3]), cfg)]), cfg)[1]
        assert [o.request_id for o in whole] == [o.request_id for o in halves] == ["c"]

    def test_float32_squares_keep_small_terms(self):
        """One large |d| among millions of small ones does not swamp the float32 sums of squares."""
        n = 4_000_000
        lr = np.full(n, -2.0)
        lt = lr + 0.01
        lt[7] = lr[7] - 8.0
        ids = [f"s{i}" for i in range(4)]
        cu = np.array([0, n // 4, n // 2, 3 * n // 4, n], dtype=np.int64)
        got, _ = compute(StepBatch.from_packed(lr.astype(np.float32), lt.astype(np.float32), cu, ids))
        ref, _ = compute(StepBatch.from_packed(lr, lt, cu, ids))
        for key in (K.RATIO_STD, K.KL_K2, K.CHI2):
            assert got[key] == pytest.approx(ref[key], rel=1e-4), key
