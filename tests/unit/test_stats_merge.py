"""`merge` of disjoint parts gives the statistics of the whole batch (what every rank reduction relies on)."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.stats import StatsConfig, compute, compute_partial, finalize, merge


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
