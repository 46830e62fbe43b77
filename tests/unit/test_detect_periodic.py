"""Periodic detector: recurring spikes far below any absolute threshold, under heavy-tailed noise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.detect import DetectorsConfig, PeriodicConfig, PeriodicDetector, build_detectors
from rlcheck.synthetic.streams import metric_stream


def first_alarm(detector, stream, start=0):
    """(step, alarm) of the first periodic alarm at or after `start`, or None."""
    for step, m in enumerate(stream.metrics):
        alarms = detector.update(step, m)
        if alarms and step >= start:
            return step, alarms[0]
    return None


def grid_outcomes(noise: str, spike_mad: float, periods, seed: int = 0):
    """Per (period, phase): periods after the first spike until the right period was reported,
    or "wrong" / "missed"."""
    out = {}
    for period in periods:
        for phase in sorted({0, period // 2 + 1 if period > 2 else 1}):
            start = 200 + phase
            stream = metric_stream(start + 8 * period + 1, seed=seed * 1000 + period, noise=noise,
                                   spike_every=period, spike_phase=phase, spike_start=200, spike_mad=spike_mad)
            found = first_alarm(PeriodicDetector(), stream)
            first_spike = stream.spike_steps[0]
            if found is None:
                out[period, phase] = "missed"
            elif (found[1].details["period"], found[1].details["phase"]) != (period, phase % period) or found[0] < first_spike:
                out[period, phase] = "wrong"
            else:
                out[period, phase] = (found[0] - first_spike) // period
    return out


class TestPeriodicDetector:
    def test_names_period_phase_and_next_step(self):
        """A 5-MAD spike every 12 steps at phase 7 is reported with period 12, phase 7 and the next step."""
        stream = metric_stream(600, seed=3, noise="t5", spike_every=12, spike_phase=7, spike_start=300)
        step, alarm = first_alarm(PeriodicDetector(), stream)
        assert alarm.kind == "periodic" and alarm.severity == "critical"
        assert alarm.details["period"] == 12 and alarm.details["phase"] == 7
        assert alarm.details["next_expected"] == step + 12
        assert step in stream.spike_steps and step <= stream.spike_steps[0] + 4 * 12

    def test_spikes_stay_below_every_other_detector(self):
        """The same spikes raise no threshold, robust-z or drift alarm: only the periodic detector sees them."""
        stream = metric_stream(600, seed=3, noise="t5", spike_every=12, spike_phase=7, spike_start=300)
        detectors = build_detectors(DetectorsConfig())
        kinds = {a.kind for step, m in enumerate(stream.metrics) for det in detectors.values() for a in det.update(step, m)}
        assert kinds == {"periodic"}

    @pytest.mark.parametrize("noise", ["t5", "contaminated"])
    def test_grid_fast(self, noise):
        """5-MAD spikes at periods 2, 7, 12, 31 and 50 (two phases each) are found with the right period."""
        out = grid_outcomes(noise, 5.0, (2, 7, 12, 31, 50))
        found = [v for v in out.values() if isinstance(v, int)]
        assert len(found) >= 0.8 * len(out), out
        assert "wrong" not in out.values(), out

    @pytest.mark.slow
    @pytest.mark.parametrize("noise", ["t5", "contaminated"])
    def test_grid_all_periods(self, noise):
        """Periods 2..50 at two phases, 5-MAD spikes: >= 80% found within 8 periods, >= 30% within 4,
        a wrong period in <= 5% (BENCHMARKS.md has the full power table)."""
        out = grid_outcomes(noise, 5.0, range(2, 51))
        values = list(out.values())
        within8 = sum(isinstance(v, int) and v <= 8 for v in values)
        within4 = sum(isinstance(v, int) and v <= 4 for v in values)
        assert within8 >= 0.8 * len(values), out
        assert within4 >= 0.3 * len(values), out
        assert values.count("wrong") <= 0.05 * len(values), out

    @pytest.mark.parametrize("noise", ["t5", "contaminated", "gaussian"])
    def test_clean_10000_steps_no_alarm(self, noise):
        """10,000 clean heavy-tailed steps raise no periodic alarm at the defaults."""
        stream = metric_stream(10_000, seed=11, noise=noise)
        assert first_alarm(PeriodicDetector(), stream) is None

    def test_level_shift_is_not_periodic(self):
        """A permanent jump of 10 MAD raises every phase alike and is not reported as periodic."""
        stream = metric_stream(800, seed=5, noise="t5")
        for m in stream.metrics[400:]:
            m[K.ABS_DIFF_CLIPPED_MEAN] += 10 * stream.mad * 3e-4
        assert first_alarm(PeriodicDetector(), stream) is None

    def test_state_round_trip_resumes(self):
        """A detector restored from a JSON state mid-stream raises the same alarms as one that never stopped."""
        stream = metric_stream(700, seed=3, noise="t5", spike_every=9, spike_phase=4, spike_start=300)
        whole = PeriodicDetector()
        expected = [(s, a.details["period"]) for s, m in enumerate(stream.metrics) for a in whole.update(s, m)]
        first = PeriodicDetector()
        for s, m in enumerate(stream.metrics[:350]):
            first.update(s, m)
        second = PeriodicDetector()
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got = [(s, a.details["period"]) for s, m in enumerate(stream.metrics) if s >= 350 for a in second.update(s, m)]
        assert expected and got == [e for e in expected if e[0] >= 350]

    def test_history_is_bounded(self):
        """The z history never grows past what the longest fold needs."""
        det = PeriodicDetector()
        for s, m in enumerate(metric_stream(3000, seed=1).metrics):
            det.update(s, m)
        assert len(det.z[K.ABS_DIFF_CLIPPED_MEAN]) == det.cfg.history
        assert len(det.base[K.ABS_DIFF_CLIPPED_MEAN]) == det.cfg.window

    def test_two_tiers_warn_then_halt(self):
        """Small spikes (4 MAD) pass the lenient tier first (a warning), the critical one later (a
        halt); large ones (30 MAD, every occurrence far out) the critical tier at once; with the
        critical tier out of reach every alarm is a warning."""
        small = metric_stream(900, seed=3, noise="t5", spike_every=12, spike_phase=7, spike_start=300, spike_mad=4)
        det = PeriodicDetector()
        alarms = [a for s, m in enumerate(small.metrics) for a in det.update(s, m)]
        assert alarms[0].severity == "warn" and alarms[0].details["period"] == 12
        assert any(a.severity == "critical" for a in alarms) and alarms[0].step < min(a.step for a in alarms if a.severity == "critical")
        large = metric_stream(700, seed=3, noise="t5", spike_every=12, spike_phase=7, spike_start=300, spike_mad=30)
        step, alarm = first_alarm(PeriodicDetector(), large)
        assert alarm.severity == "critical" and alarm.details["period"] == 12 and step <= 300 + 12 * 6
        det = PeriodicDetector(PeriodicConfig(critical_threshold=1e9))
        assert all(a.severity == "warn" for s, m in enumerate(large.metrics) for a in det.update(s, m))

    def test_stride_two_finds_the_period_in_steps(self):
        """Observed at steps 0, 2, 4, ... (TRL's num_iterations=2), spikes every 12 observations are
        found as every 24 steps, 12 observations, at their phase."""
        det = PeriodicDetector()
        stream = metric_stream(600, seed=3, noise="t5", spike_every=12, spike_phase=7, spike_start=300)
        found = None
        for i, m in enumerate(stream.metrics):
            alarms = det.update(2 * i, m)
            if alarms:
                found = (2 * i, alarms[0])
                break
        assert found is not None
        step, alarm = found
        assert alarm.details["period"] == 24 and alarm.details["period_observations"] == 12
        assert alarm.details["stride"] == 2 and alarm.details["phase"] == 14 and step % 24 == 14
        assert "every 24 steps (12 observations" in alarm.message

    def test_irregular_gaps_keep_the_phase(self):
        """Steps lost at random (10% of them never observed) leave holes, not a reset: the period
        in steps is still found."""
        det = PeriodicDetector()
        stream = metric_stream(700, seed=4, noise="t5", spike_every=10, spike_phase=3, spike_start=300)
        lost = np.random.default_rng(0).random(700) < 0.1
        found = None
        for s, m in enumerate(stream.metrics):
            if lost[s]:
                continue
            alarms = det.update(s, m)
            if alarms:
                found = (s, alarms[0])
                break
        assert found is not None and found[1].details["period"] == 10 and found[0] % 10 == 3

    def test_clean_stream_with_gaps_stays_quiet(self):
        """A clean heavy-tailed stream observed at stride 2 with random holes raises nothing."""
        det = PeriodicDetector()
        stream = metric_stream(3000, seed=5, noise="t5")
        lost = np.random.default_rng(1).random(3000) < 0.05
        fired = [s for s, m in enumerate(stream.metrics) if not lost[s] and det.update(2 * s, m)]
        assert fired == []

    def test_repeated_steps_drop_the_abandoned_history(self):
        """A trainer resumed from an earlier checkpoint repeats steps: the z-scores and the rolling
        baseline's values from that step on are dropped, the earlier ones kept (the baseline's oldest,
        evicted before the rewind, do not come back), through a state round trip too."""
        key = K.ABS_DIFF_CLIPPED_MEAN
        det, fresh = PeriodicDetector(), PeriodicDetector()
        stream = metric_stream(300, seed=1)
        values = [m[key] for m in stream.metrics]
        for s, m in enumerate(stream.metrics[:200]):
            det.update(s, m)
            fresh.update(s, m) if s < 180 else None
        held = len(det.z[key])
        det.update(180, stream.metrics[200])
        fresh.update(180, stream.metrics[200])
        assert len(det.z[key]) == held - 20 + 1
        assert list(det.steps[key])[-2:] == [179, 180]
        assert list(det.steps[key]) == list(fresh.steps[key]) and list(det.z[key])[:-1] == list(fresh.z[key])[:-1]
        assert list(det.base_steps[key]) == list(range(72, 181))  # 72..199 held before the rewind
        assert det.base[key].state_dict() == values[72:180] + [values[200]]
        clone = PeriodicDetector()
        clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
        clone.update(170, stream.metrics[201])
        assert list(clone.base_steps[key]) == list(range(72, 171))
        assert clone.base[key].state_dict() == values[72:170] + [values[201]]

    def test_state_of_an_earlier_version_loads(self):
        """state.json written before step grids (z-scores and last_step) still loads, consecutive."""
        det = PeriodicDetector()
        det.load_state_dict({K.ABS_DIFF_CLIPPED_MEAN: {"base": [1.0] * 40, "z": [0.1, 0.2, 0.3], "last_step": 41}})
        assert list(det.steps[K.ABS_DIFF_CLIPPED_MEAN]) == [39, 40, 41]

    @pytest.mark.parametrize("bad", [dict(min_period=1), dict(folds=()), dict(min_hit_frac=0), dict(severity="loud")])
    def test_config_validation(self, bad):
        """Out-of-range settings raise ValueError."""
        with pytest.raises(ValueError):
            PeriodicConfig(**bad)

    def test_ignores_missing_metric(self):
        """A step without the watched metric is skipped, not an error."""
        assert PeriodicDetector().update(0, {}) == []

    def test_metric_stream_mad(self):
        """The stream's MAD is the MAD of its clean noise."""
        stream = metric_stream(5000, seed=2, noise="gaussian")
        assert stream.mad == pytest.approx(0.6745, rel=0.05)
        assert np.isfinite(stream.mad)
