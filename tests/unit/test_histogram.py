"""Tests of rlcheck.core.histogram: exact bin edges, quantiles read back within one bin."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core import histogram as H

BIN_RTOL = 1.0 / 16  # bins are 1/16 octave wide: a quantile is off by at most one bin width


class TestAbsHistogram:
    def test_shape_and_dtype(self):
        """The histogram has NUM_ABS_BINS int64 counts, one per lower edge."""
        hist = H.abs_histogram(np.array([0.5, 1.0]))
        assert hist.shape == (H.NUM_ABS_BINS,) and hist.dtype == np.int64
        assert H.ABS_EDGES.shape == (H.NUM_ABS_BINS,)
        assert np.all(np.diff(H.ABS_EDGES) > 0)

    def test_edges_are_powers_of_two_split_in_sixteen(self):
        """Bin 0 starts at 0, bin 1 at 2**-30, the overflow bin at 2**12, 16 bins per octave between."""
        assert H.ABS_EDGES[0] == 0.0
        assert H.ABS_EDGES[1] == 2.0**-30
        assert H.ABS_EDGES[-1] == 2.0**12
        assert H.ABS_EDGES[1 + 16] == 2.0**-29
        sub = np.arange(H.NUM_ABS_BINS - 2) % 16  # sub-bin k: edge 2**e * (1 + k/16)
        np.testing.assert_allclose(H.ABS_EDGES[2:] / H.ABS_EDGES[1:-1] - 1, 1 / (16 + sub), rtol=1e-12)

    def test_value_on_an_edge_lands_in_that_bin(self):
        """Every lower edge above 0 is counted in its own bin, and the float32 just below it in the bin before."""
        edges = H.ABS_EDGES[1:].astype(np.float32)
        hist = H.abs_histogram(edges)
        np.testing.assert_array_equal(hist, np.r_[0, np.ones(H.NUM_ABS_BINS - 1, dtype=np.int64)])
        below = np.nextafter(edges, np.float32(0))
        hist_below = H.abs_histogram(below)
        np.testing.assert_array_equal(hist_below, np.r_[np.ones(H.NUM_ABS_BINS - 1, dtype=np.int64), 0])

    @pytest.mark.parametrize("value", [0.0, 1e-12, 2.0**-30 * 0.999])
    def test_tiny_values_land_in_bin_zero(self, value):
        """Zero and anything below 2**-30 is counted in bin 0."""
        hist = H.abs_histogram(np.array([value]))
        assert hist[0] == 1 and hist.sum() == 1

    @pytest.mark.parametrize("value", [2.0**12, 1e6, 1e30])
    def test_huge_values_land_in_the_overflow_bin(self, value):
        """Values at or past 2**12 (even past the float32 range) land in the last bin."""
        hist = H.abs_histogram(np.array([value]))
        assert hist[-1] == 1 and hist.sum() == 1

    def test_counts_sum_to_n(self):
        """Every value is counted exactly once, float32 and float64 inputs alike."""
        rng = np.random.default_rng(0)
        x = np.abs(rng.standard_cauchy(10_000)) * 10.0 ** rng.uniform(-12, 4, 10_000)
        x[:50] = 0.0
        for arr in (x, x.astype(np.float32)):
            hist = H.abs_histogram(arr)
            assert hist.sum() == x.size and (hist >= 0).all()

    def test_each_value_falls_between_its_bin_edges(self):
        """A float32 value v in bin j satisfies ABS_EDGES[j] <= v < ABS_EDGES[j+1]."""
        rng = np.random.default_rng(1)
        x = (10.0 ** rng.uniform(-10, 4, 2000)).astype(np.float32)
        for v in x:
            j = int(np.argmax(H.abs_histogram(np.array([v]))))
            assert H.ABS_EDGES[j] <= v
            if j + 1 < H.NUM_ABS_BINS:
                assert v < H.ABS_EDGES[j + 1]

    def test_histograms_add(self):
        """The histogram of a concatenation is the sum of the histograms (what merging ranks relies on)."""
        rng = np.random.default_rng(2)
        a, b = rng.exponential(0.01, 500), rng.exponential(3.0, 700)
        np.testing.assert_array_equal(H.abs_histogram(np.r_[a, b]), H.abs_histogram(a) + H.abs_histogram(b))


class TestQuantile:
    @pytest.mark.parametrize("q", [0.01, 0.1, 0.5, 0.9, 0.99, 0.999])
    def test_lognormal_over_eight_decades(self, q):
        """quantile() of lognormal data spanning ~8 decades is within one bin of np.quantile."""
        rng = np.random.default_rng(3)
        x = rng.lognormal(mean=np.log(1e-3), sigma=3.0, size=50_000)  # 1e-3 * e^{+-3 sigma}: ~8 decades
        assert np.log10(np.quantile(x, 0.999) / np.quantile(x, 0.001)) > 7
        got = H.quantile(H.abs_histogram(x), H.ABS_EDGES, q, float(x.max()))
        np.testing.assert_allclose(got, np.quantile(x, q), rtol=BIN_RTOL)

    def test_capped_by_the_maximum(self):
        """A quantile never exceeds `upper`, the exact maximum, even in the open overflow bin."""
        x = np.array([5000.0, 6000.0, 7000.0])
        got = H.quantile(H.abs_histogram(x), H.ABS_EDGES, 0.99, 7000.0)
        assert 2.0**12 <= got <= 7000.0

    def test_constant_values(self):
        """A histogram of one repeated value gives a quantile within one bin of that value."""
        x = np.full(100, 0.3)
        got = H.quantile(H.abs_histogram(x), H.ABS_EDGES, 0.5, 0.3)
        np.testing.assert_allclose(got, 0.3, rtol=BIN_RTOL)

    def test_zeros_give_zero(self):
        """Exact zeros give a quantile below 2**-30 (bin 0), never a negative one."""
        got = H.quantile(H.abs_histogram(np.zeros(10)), H.ABS_EDGES, 0.5, 0.0)
        assert got == 0.0

    def test_empty_histogram_gives_zero(self):
        """An empty histogram reads back as 0.0, not NaN."""
        assert H.quantile(np.zeros(H.NUM_ABS_BINS, dtype=np.int64), H.ABS_EDGES, 0.5, 0.0) == 0.0

    def test_quantiles_are_monotone(self):
        """Higher q never gives a smaller quantile."""
        rng = np.random.default_rng(4)
        x = rng.lognormal(-5.0, 2.0, 5000)
        hist = H.abs_histogram(x)
        qs = [H.quantile(hist, H.ABS_EDGES, q, float(x.max())) for q in np.linspace(0.01, 0.99, 50)]
        assert np.all(np.diff(qs) >= 0)


class TestPositionHistogram:
    def test_exact_below_64(self):
        """Positions 0..63 each get their own bin, whose lower edge is the position itself."""
        hist = H.position_histogram(np.arange(64))
        assert hist.shape == (H.NUM_POS_BINS,) and hist.dtype == np.int64
        np.testing.assert_array_equal(hist[:64], np.ones(64))
        assert hist[64:].sum() == 0
        np.testing.assert_array_equal(H.POS_EDGES[:64], np.arange(64))

    def test_repeated_positions_are_counted(self):
        """Counts below 64 equal np.bincount of the positions."""
        rng = np.random.default_rng(5)
        pos = rng.integers(0, 64, 1000)
        np.testing.assert_array_equal(H.position_histogram(pos)[:64], np.bincount(pos, minlength=64))

    def test_log_bins_from_64(self):
        """From 64 on, bins are 1/16 octave wide: 64..67 share a bin, 68 starts the next."""
        hist = H.position_histogram(np.array([64, 65, 66, 67, 68]))
        assert hist[64] == 4 and hist[65] == 1
        assert H.POS_EDGES[64] == 64 and H.POS_EDGES[65] == 68

    def test_large_positions_are_counted(self):
        """Very large positions are still counted (in the last bin at worst)."""
        pos = np.array([10**6, 10**9, 2**40])
        hist = H.position_histogram(pos)
        assert hist.sum() == 3


class TestPositionQuantile:
    @pytest.mark.parametrize("q", [0.1, 0.25, 0.5, 0.75, 0.9])
    @pytest.mark.parametrize("n", [1, 2, 7, 100])
    def test_exact_below_64(self, q, n):
        """Below 64 the quantile is exact: the smallest position with cdf >= q (inverted cdf)."""
        rng = np.random.default_rng(n)
        pos = rng.integers(0, 64, n)
        got = H.position_quantile(H.position_histogram(pos), q)
        assert got == int(np.quantile(pos, q, method="inverted_cdf"))

    def test_median_of_odd_count(self):
        """The median of an odd number of positions is the middle one."""
        assert H.position_quantile(H.position_histogram(np.array([40, 3, 9])), 0.5) == 9

    def test_within_one_bin_above_64(self):
        """Above 64 the quantile is the lower edge of the bin that holds it (within 1/16 octave)."""
        rng = np.random.default_rng(6)
        pos = rng.integers(64, 100_000, 999)
        got = H.position_quantile(H.position_histogram(pos), 0.5)
        want = np.quantile(pos, 0.5, method="inverted_cdf")
        assert got <= want < got * (1 + BIN_RTOL)
