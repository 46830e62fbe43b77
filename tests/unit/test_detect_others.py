"""Threshold, robust z, drift and signature detectors; the clean 10,000-step run across all of them."""

from __future__ import annotations

import json

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.detect import (
    Alarm,
    DetectorsConfig,
    DriftConfig,
    DriftDetector,
    RobustZConfig,
    RobustZDetector,
    SignatureConfig,
    SignatureDetector,
    ThresholdConfig,
    ThresholdDetector,
    ThresholdRule,
    build_detectors,
)
from rlcheck.errors import ConfigError
from rlcheck.synthetic.streams import metric_stream


def run(detector, metrics_list, start=0):
    return [a for s, m in enumerate(metrics_list, start) for a in detector.update(s, m)]


class TestAlarm:
    def test_round_trip(self):
        """to_dict / from_dict round-trip through JSON."""
        a = Alarm("periodic", K.ABS_DIFF_MEAN, 7, "critical", "msg", {"period": 3, "phase": 1})
        assert Alarm.from_dict(json.loads(json.dumps(a.to_dict()))) == a

    def test_rejects_unknown_kind_and_severity(self):
        """Only the documented kinds and severities are accepted."""
        with pytest.raises(ValueError):
            Alarm("weird", "m", 0, "warn", "")
        with pytest.raises(ValueError):
            Alarm("drift", "m", 0, "panic", "")


class TestThresholdDetector:
    def test_fires_above_limit_only(self):
        """A metric above its limit raises the rule's severity; at or below, nothing."""
        det = ThresholdDetector(ThresholdConfig(rules=(ThresholdRule(K.ABS_DIFF_MEAN, 0.1, "critical"),)))
        assert det.update(0, {K.ABS_DIFF_MEAN: 0.1}) == []
        (a,) = det.update(1, {K.ABS_DIFF_MEAN: 0.2})
        assert (a.kind, a.severity, a.details["limit"]) == ("threshold", "critical", 0.1)

    def test_default_gates_are_tail_robust(self):
        """Defaults carry verl's probs_diff_mean 0.01 gate and the clipped mean |d|, not NeMo-RL's
        mean exp|d| (one tail token moves it by e^|d| / tokens)."""
        limits = {r.metric: r.limit for r in ThresholdConfig().rules if not r.metric.startswith(K.TURN_PREFIX)}
        # multi-turn steps add theirs; a dense model whose trainer measured its floor, the engine over that measure
        assert limits == {K.PROB_ABS_DIFF_MEAN: 0.01, K.ABS_DIFF_CLIPPED_MEAN: 0.05, K.FLOOR_EXCESS: 2.0}
        assert [r.metric for r in ThresholdConfig().rules if r.dense_only] == [K.FLOOR_EXCESS]

    def test_rearms_after_time_below(self):
        """After an alarm the rule is quiet while the metric stays above, and fires again only after
        `rearm` observations at or below the limit; rearm=None alarms on every step above."""
        rules = (ThresholdRule(K.ABS_DIFF_MEAN, 0.1),)
        det = ThresholdDetector(ThresholdConfig(rules=rules, rearm=3))
        values = [0.2, 0.2, 0.05, 0.2, 0.05, 0.05, 0.05, 0.2, 0.2]
        fired = [s for s, v in enumerate(values) if det.update(s, {K.ABS_DIFF_MEAN: v})]
        assert fired == [0, 7]
        every = ThresholdDetector(ThresholdConfig(rules=rules, rearm=None))
        assert [s for s, v in enumerate(values) if every.update(s, {K.ABS_DIFF_MEAN: v})] == [0, 1, 3, 7, 8]
        clone = ThresholdDetector(ThresholdConfig(rules=rules, rearm=3))
        clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
        assert clone.quiet == det.quiet == [3]

    def test_missing_metric_skipped(self):
        """A rule whose metric is absent this step does nothing."""
        assert ThresholdDetector().update(0, {}) == []


class TestRobustZDetector:
    def test_fires_on_sudden_spike_after_warmup(self):
        """A 3x jump in mean |d| after a steady history is a robust-z alarm; during warm-up nothing fires."""
        stream = metric_stream(200, seed=1, noise="gaussian").metrics
        det = RobustZDetector()
        spike = dict(stream[10], **{K.ABS_DIFF_CLIPPED_MEAN: 0.5})
        assert det.update(0, spike) == []
        assert run(det, stream[1:150], start=1) == []
        alarms = det.update(150, dict(stream[150], **{K.ABS_DIFF_CLIPPED_MEAN: 3e-3 * 3}))
        assert [a.metric for a in alarms] == [K.ABS_DIFF_CLIPPED_MEAN]
        assert alarms[0].details["z"] > RobustZConfig().z_threshold

    def test_downward_move_is_not_an_alarm(self):
        """Mismatch falling to zero is good news, not a spike."""
        stream = metric_stream(100, seed=1).metrics
        det = RobustZDetector()
        run(det, stream)
        assert det.update(100, {K.ABS_DIFF_CLIPPED_MEAN: 0.0}) == []

    def test_constant_series_does_not_explode(self):
        """An exact-match history (all zeros) scores a tiny wobble as finite, via the scale floor."""
        det = RobustZDetector()
        run(det, [{K.ABS_DIFF_CLIPPED_MEAN: 0.0}] * 64)
        (a,) = det.update(64, {K.ABS_DIFF_CLIPPED_MEAN: 1e-3})
        assert a.details["z"] < float("inf")

    def test_state_round_trip(self):
        """A restored detector continues with the same baseline."""
        det = RobustZDetector()
        run(det, metric_stream(100, seed=2).metrics)
        clone = RobustZDetector()
        clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
        m = {K.ABS_DIFF_CLIPPED_MEAN: 0.02}
        assert [a.details["z"] for a in clone.update(100, m)] == [a.details["z"] for a in det.update(100, m)]


class TestDriftDetector:
    @staticmethod
    def ramp(rate: float, start: int = 200, n: int = 400) -> list[dict]:
        base = metric_stream(n, seed=4, noise="gaussian").metrics
        key = K.ABS_DIFF_CLIPPED_MEAN
        return [dict(m, **{key: m[key] * (rate ** max(0, s - start))}) for s, m in enumerate(base)]

    def test_growth_is_caught(self):
        """Mean |d| growing 3% per step (no single step a spike) raises a drift alarm with its start,
        warn while below critical_ratio x the reference, critical past it."""
        alarms = [a for a in run(DriftDetector(), self.ramp(1.03)) if a.metric == K.ABS_DIFF_CLIPPED_MEAN]
        assert alarms and 200 < alarms[0].step < 260
        assert alarms[0].details["since_step"] >= 195
        assert alarms[0].severity == "warn" and alarms[0].details["ratio"] < DriftConfig().critical_ratio
        assert any(a.severity == "critical" and a.details["ratio"] >= 3 for a in alarms)
        assert not [a for a in run(RobustZDetector(), self.ramp(1.03)[:240]) if a.metric == K.ABS_DIFF_CLIPPED_MEAN]

    def test_healthy_floor_growth_is_not_a_drift(self):
        """The field's healthy floor (10x over 2,000 steps, ~0.12% a step) raises nothing."""
        assert run(DriftDetector(), self.ramp(10 ** (1 / 2000), start=0, n=3000)) == []

    def test_stale_weights_jump_is_critical_within_steps(self):
        """A mismatch that quadruples and stays (weights no longer synced) is a critical drift within
        six steps."""
        stream = self.ramp(1.0)
        jumped = [dict(m, **{K.ABS_DIFF_CLIPPED_MEAN: m[K.ABS_DIFF_CLIPPED_MEAN] * (4 if s >= 300 else 1)})
                  for s, m in enumerate(stream)]
        alarms = run(DriftDetector(), jumped)
        assert alarms and alarms[0].severity == "critical" and 300 <= alarms[0].step <= 305
        assert alarms[0].details["since_step"] == 300

    def test_one_low_step_does_not_reset_the_drift(self):
        """A 2.5x drift alarms within two steps of where it does without a dip when one step in the middle
        reads 0.05x (a batch of short answers): the CUSUM caps each step's fall as it caps its rise."""
        key = K.ABS_DIFF_CLIPPED_MEAN
        drift = [dict(m, **{key: m[key] * 2.5 ** min(1.0, max(0, s - 60) / 10)}) for s, m in enumerate(self.ramp(1.0))]
        plain = [a.step for a in run(DriftDetector(), drift)][0]
        dipped = [dict(m, **{key: m[key] * 0.05}) if s == plain - 3 else m for s, m in enumerate(drift)]
        assert plain - 3 > 64 and [a.step for a in run(DriftDetector(), dipped)][0] <= plain + 2

    def test_state_round_trip(self):
        """CUSUM and baseline survive a JSON round trip."""
        det = DriftDetector()
        run(det, metric_stream(120, seed=2).metrics)
        det.cusum[K.ABS_DIFF_CLIPPED_MEAN] = 3.5
        clone = DriftDetector()
        clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
        assert clone.cusum == det.cusum and clone.state_dict() == det.state_dict()

    def test_config_validation(self):
        """clip must exceed slack, critical_ratio 1."""
        with pytest.raises(ValueError):
            DriftConfig(slack=5.0, clip=4.0)
        with pytest.raises(ConfigError):
            DriftConfig(critical_ratio=1.0)


def clean_sig(**over):
    m = {K.TOKEN_COUNT: 10_000.0, K.ABS_DIFF_MEAN: 1e-3, K.SIG_SHIFT_GAIN: 0.001, K.SIG_SHIFT_BASE: 1e-3,
         K.SIG_SHIFT_DIRECTION: 1.0, K.SIG_SLOPE: 0.0, K.SIG_SLOPE_CORR: 0.01, K.SEQ_CATASTROPHIC_COUNT: 0.0,
         K.SEQ_CATASTROPHIC_FRAC: 0.0, K.SIG_EARLY_DIV_COUNT: 0.0}
    m.update(over)
    return m


class TestSignatureDetector:
    def test_clean_step_is_silent(self):
        """Healthy statistics raise no signature."""
        assert SignatureDetector().update(0, clean_sig()) == []

    @pytest.mark.parametrize(
        "over, name, severity",
        [
            ({K.SIG_TOKEN_MISMATCH_COUNT: 3.0, K.SIG_TOKEN_MISMATCH_FRAC: 3e-4}, "token_id_mismatch", "critical"),
            ({K.SIG_SHIFT_GAIN: 8.0, K.SIG_SHIFT_BASE: 1.2, K.SIG_SHIFT_DIRECTION: -1.0}, "shift_by_one", "critical"),
            ({K.SIG_SLOPE: -0.3, K.SIG_SLOPE_CORR: -0.9, K.ABS_DIFF_MEAN: 0.2}, "systematic_slope", "warn"),
            ({K.SEQ_CATASTROPHIC_COUNT: 2.0, K.SEQ_CATASTROPHIC_FRAC: 0.002, K.SIG_EARLY_DIV_COUNT: 2.0}, "early_divergence", "warn"),
            ({K.SEQ_CATASTROPHIC_COUNT: 2.0, K.SEQ_CATASTROPHIC_FRAC: 0.002}, "sparse_catastrophic", "warn"),
        ],
    )
    def test_each_signature(self, over, name, severity):
        """Each shape raises exactly its own signature with its default severity."""
        (a,) = SignatureDetector().update(3, clean_sig(**over))
        assert (a.kind, a.details["signature"], a.severity, a.step) == ("signature", name, severity, 3)

    def test_shift_needs_real_mismatch(self):
        """A shift gain on noise-level |d| (below shift_min_abs_diff) is not an alarm."""
        assert SignatureDetector().update(0, clean_sig(**{K.SIG_SHIFT_GAIN: 9.0, K.SIG_SHIFT_BASE: 0.01})) == []

    @pytest.mark.parametrize("frac", [0.15, 0.2, 0.24, 0.5])
    def test_many_catastrophic_sequences_alarm_and_recur(self, frac):
        """Past sparse_max_frac (under the 0.25 hard limit, or past it) catastrophic sequences that do not
        diverge early are `many_catastrophic`, not silence, and count toward the recurrence escalation."""
        det = SignatureDetector()
        many = clean_sig(**{K.SEQ_COUNT: 100.0, K.SEQ_CATASTROPHIC_COUNT: 100 * frac, K.SEQ_CATASTROPHIC_FRAC: frac})
        (a,) = det.update(0, many)
        assert (a.details["signature"], a.severity) == ("many_catastrophic", "warn")
        (b,) = det.update(1, clean_sig(**{K.SEQ_CATASTROPHIC_COUNT: 1.0, K.SEQ_CATASTROPHIC_FRAC: 0.01}))
        assert (b.details["signature"], b.severity, b.details["recurrences"]) == ("sparse_catastrophic", "critical", 2)

    def test_lasting_slope_turns_critical(self):
        """The slope signature on slope_critical_after consecutive observations is critical; a break
        in the streak starts it over."""
        det = SignatureDetector()
        sloped = clean_sig(**{K.SIG_SLOPE: -0.02, K.SIG_SLOPE_CORR: -0.7, K.ABS_DIFF_MEAN: 0.02})
        severities = [a.severity for s in range(5) for a in det.update(s, sloped)]
        assert severities == ["warn", "warn", "warn", "critical", "critical"]
        assert det.update(5, clean_sig()) == []
        assert [a.severity for a in det.update(6, sloped)] == ["warn"]

    def test_recurring_catastrophe_turns_critical(self):
        """Catastrophic sequences in recur_count observations within recur_window are critical; a
        lone one long after the last is a warning again."""
        det = SignatureDetector()
        bad = clean_sig(**{K.SEQ_CATASTROPHIC_COUNT: 1.0, K.SEQ_CATASTROPHIC_FRAC: 0.01})
        assert [a.severity for a in det.update(0, bad)] == ["warn"]
        for s in range(1, 50):
            det.update(s, clean_sig())
        (a,) = det.update(50, bad)
        assert a.severity == "critical" and a.details["recurrences"] == 2
        for s in range(51, 400):
            det.update(s, clean_sig())
        assert [a.severity for a in det.update(400, bad)] == ["warn"]
        clone = SignatureDetector()
        clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
        assert clone.update(401, bad)[0].severity == det.update(401, bad)[0].severity == "critical"

    def test_severity_override(self):
        """A signature's severity can be raised by name; unknown names are rejected."""
        det = SignatureDetector(SignatureConfig(severity={"sparse_catastrophic": "critical"}))
        (a,) = det.update(0, clean_sig(**{K.SEQ_CATASTROPHIC_COUNT: 1.0, K.SEQ_CATASTROPHIC_FRAC: 0.001}))
        assert a.severity == "critical"
        with pytest.raises(ValueError):
            SignatureConfig(severity={"nope": "warn"})


class TestCleanStream:
    @pytest.mark.parametrize("noise", ["t5", "gaussian"])
    def test_10000_clean_steps_zero_alarms(self, noise):
        """Every detector at its defaults stays silent over 10,000 clean heavy-tailed steps."""
        detectors = build_detectors(DetectorsConfig())
        stream = metric_stream(10_000, seed=21, noise=noise).metrics
        alarms = [a for s, m in enumerate(stream) for det in detectors.values() for a in det.update(s, m)]
        assert alarms == []
