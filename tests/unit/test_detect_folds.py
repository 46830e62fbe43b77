"""The periodic detector's vectorised fold test equals the per-(period, k) loop it replaced (kept here
as its specification), on clean, spiky, gapped and short series and under every tier's config."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rlcheck.core.detect import PeriodicConfig, PeriodicDetector
from rlcheck.core.detect.folds import passing_folds
from rlcheck.synthetic.streams import metric_stream


def reference_passing_folds(rz: np.ndarray, cfg: PeriodicConfig) -> list[tuple[int, int, float, int]]:
    """The loop over periods and folds, as the detector computed it before."""
    seen = ~np.isnan(rz)
    raw = np.where(seen, rz, 0.0)
    rz = np.clip(raw, -cfg.clip, cfg.clip)
    csum, csum2, ccount = np.cumsum(rz), np.cumsum(rz * rz), np.cumsum(seen)
    out = []
    for period in range(cfg.min_period, cfg.max_period + 1):
        fold, fraw, fseen = rz[::period], raw[::period], seen[::period]
        fsum, fsum2, fcount = np.cumsum(fold), np.cumsum(fold * fold), np.cumsum(fseen)

        def other(span, period=period, fsum=fsum, fsum2=fsum2, fcount=fcount):
            j = -(-span // period) - 1
            return csum[span - 1] - fsum[j], csum2[span - 1] - fsum2[j], int(ccount[span - 1] - fcount[j])

        for k in cfg.folds:
            span = max(k * period, cfg.min_other)
            if fold.shape[0] < k or rz.shape[0] < span:
                continue
            k_seen = int(fcount[k - 1])
            s1, _, n_other = other(span)
            if k_seen < min(cfg.folds) or n_other < cfg.min_other // 2:
                continue
            other_mean = s1 / n_other
            v1, v2, n_var = other(min(max(span, cfg.min_var_span), rz.shape[0]))
            spread = math.sqrt(max(v2 / n_var - (v1 / n_var) ** 2, 1.0))
            occ = np.clip(fraw[:k][fseen[:k]], -cfg.clip * spread, cfg.clip * spread)
            score = (occ.sum() - k_seen * other_mean) / (spread * math.sqrt(k_seen + k_seen**2 / n_other))
            if score < cfg.threshold:
                continue
            hits = int(np.count_nonzero(occ > other_mean + cfg.hit_z * spread))
            halves_agree = occ[::2].mean() - occ[1::2].mean() <= cfg.harmonic_gap * spread
            if k_seen - hits <= int(k_seen * (1.0 - cfg.min_hit_frac)) and halves_agree:
                out.append((period, k, float(score), hits))
    return out


def same(a, b) -> bool:
    return [(p, k, h) for p, k, _, h in a] == [(p, k, h) for p, k, _, h in b] and \
        np.allclose([s for *_, s, _ in a], [s for *_, s, _ in b], rtol=1e-12, atol=0)


def series(kind: str, seed: int) -> np.ndarray:
    """A newest-first z-score grid like the detector's: spiky, clean, with holes, or short."""
    rng = np.random.default_rng(seed)
    n = {"short": int(rng.integers(1, 120))}.get(kind, 801)
    z = rng.standard_t(5, n)
    if kind in ("spiky", "holes"):
        period, phase = int(rng.integers(2, 51)), 0
        z[phase::period] += rng.uniform(2.0, 6.0)
    if kind == "holes":
        z[rng.random(n) < 0.3] = np.nan
        z[0] = abs(z[0]) + 1.0
    return np.clip(z, -14.0, 14.0)


RELAXED = PeriodicConfig(threshold=1e-9, min_hit_frac=1e-9, harmonic_gap=1e9)  # the periodogram's: most folds pass


@pytest.mark.parametrize("kind", ["clean", "spiky", "holes", "short"])
def test_vectorised_folds_equal_the_loop(kind):
    detector = PeriodicDetector()
    configs = (detector.cfg, detector.critical_cfg, RELAXED, dataclasses.replace(RELAXED, min_period=7, max_period=9))
    passed = 0
    for seed in range(12):
        rz = series(kind, seed)
        for cfg in configs:
            want = reference_passing_folds(rz, cfg)
            got = passing_folds(rz, cfg)
            assert same(got, want), (kind, seed, cfg, got[:5], want[:5])
            passed += len(want)
    assert kind == "clean" or passed > 0  # the comparison saw folds that pass


def test_detector_alarms_unchanged_on_a_periodic_stream():
    """Through the detector: the same alarms, step for step, as the loop gives."""
    stream = metric_stream(900, seed=4, noise="contaminated", spike_every=9, spike_phase=3, spike_start=400)
    fast, slow = PeriodicDetector(), PeriodicDetector()
    slow.passing_folds = lambda rz, cfg=None: reference_passing_folds(rz, cfg or slow.cfg)
    for step, m in enumerate(stream.metrics):
        a, b = fast.update(step, m), slow.update(step, m)
        assert [(x.severity, x.details) for x in a] == [(x.severity, x.details) for x in b], step
