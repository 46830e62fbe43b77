"""Detector power on the shapes of issue 28 item 4 (`rlcheck.synthetic.power`), on the test seeds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import CONTROL_DRIFT, CONTROL_TREND, RESIDUAL_TREND, DriftDetector, PeriodicDetector
from rlcheck.core.quarantine import QuarantineConfig, judge
from rlcheck.core.stats import StatsConfig, compute_partial, finalize
from rlcheck.core.stats.levels import level_spread, probe_level
from rlcheck.synthetic.field import FieldStream
from rlcheck.synthetic.power import DRIFTS, PARTIAL_SPIKES, corrupt_tail
from rlcheck.synthetic.scenarios import SCENARIOS, TEST_SEEDS

SEED = TEST_SEEDS[0]


def step_metrics(stream: FieldStream, i: int) -> dict[str, float]:
    batch = stream.batches(i)[0]
    metrics, _ = finalize(compute_partial(batch))
    return {**metrics, **level_spread(batch, StatsConfig().clip)}


def probe_alarms(field, fault, num_steps: int, cfg) -> list[int]:
    stream = FieldStream(dataclasses.replace(field, seed=SEED), fault, num_steps)
    det = DriftDetector(cfg)
    return [i for i in range(num_steps) if det.update(stream.step(i), probe_level(stream.probe_batch(i), 0.5))]


class TestPartialSpikes:
    def test_found_within_eight_periods(self):
        """A third of the sequences at 2.5x every 12 gapped observations alarms within 8 periods."""
        fault = dataclasses.replace(PARTIAL_SPIKES.fault, onset=64)
        stream = FieldStream(dataclasses.replace(PARTIAL_SPIKES.field, seed=SEED), fault, 64 + 12 * 8 + 1)
        det = PeriodicDetector()
        found = [i for i in range(stream.num_steps) if det.update(stream.step(i), step_metrics(stream, i))]
        assert found and 64 <= found[0] <= 64 + 12 * 8

    def test_healthy_stream_is_quiet(self):
        """The same gapped stream without the fault raises no periodic alarm in 300 observations."""
        stream = FieldStream(dataclasses.replace(PARTIAL_SPIKES.field, seed=SEED), None, 300)
        det = PeriodicDetector()
        assert [i for i in range(300) if det.update(stream.step(i), step_metrics(stream, i))] == []

    def test_level_spread_ignores_the_common_level(self):
        """Scaling every sequence's mismatch alike leaves the spread where it was."""
        batch = FieldStream(dataclasses.replace(PARTIAL_SPIKES.field, seed=SEED), None, 1).batches(0)[0]
        halved = dataclasses.replace(batch, logp_train=batch.logp_rollout + 0.5 * (batch.logp_train - batch.logp_rollout))
        a, b = level_spread(batch, 10.0), level_spread(halved, 10.0)
        assert abs(a[K.SEQ_LEVEL_SPREAD] - b[K.SEQ_LEVEL_SPREAD]) < 1e-4  # float32 logprobs


class TestCorruptTails:
    def test_short_corrupted_tails_are_quarantined(self):
        """Last 8-15 tokens at d ~ N(0, 2) nats: 29 of 30 quarantined (the 30th shows one token past
        0.5 nats: nothing tells it from a healthy tail token), and no healthy sequence."""
        stream = FieldStream(dataclasses.replace(SCENARIOS["gapped"].field, seed=SEED), None, 30)
        caught = 0
        for i in range(30):
            batch, k = corrupt_tail(stream.batches(i)[0], SEED, i)
            condemned = np.flatnonzero(~judge(batch, StatsConfig(), QuarantineConfig()).keep).tolist()
            assert set(condemned) <= {k}
            caught += condemned == [k]
        assert caught == 29


    @pytest.mark.parametrize("engine_p, condemned", [(0.99, True), (0.3, False)])
    def test_one_broken_sure_token_in_the_tail(self, engine_p, condemned):
        """One tail token 1.2 nats off: on a token the engine was sure of (p 0.99, healthy noise there
        is under 0.1 nats) the tail is corrupted; on an uncertain one (p 0.3) it is a healthy tail token."""
        n, length = 8, 64
        lr = np.full(n * length, np.log(0.5))
        k, at = 3, 4 * length - 5  # sequence 3, its fifth token from the end
        lr[at] = np.log(engine_p)
        lt = lr.copy()
        lt[at] -= 1.2
        cu = np.arange(0, n * length + 1, length)
        batch = StepBatch.from_packed(lr, lt, cu, [f"s{i}" for i in range(n)])
        assert (np.flatnonzero(~judge(batch, StatsConfig(), QuarantineConfig()).keep).tolist() == [k]) is condemned
        off = judge(batch, StatsConfig(), QuarantineConfig(tail_span=None))
        assert off.keep.all()  # the rate rule alone keeps it either way


class TestControlDrift:
    def test_fast_rise_within_ten_steps(self):
        """The probe's 3.3x rise over 30 steps warns within 10 steps, never before the onset."""
        s = DRIFTS[0]
        found = probe_alarms(s.field, s.fault, s.num_steps, CONTROL_DRIFT)
        assert found and s.fault.onset <= found[0] <= s.fault.onset + 10

    def test_slow_rise_before_twice(self):
        """The probe's 5x rise over 450 steps warns before the engine's mismatch doubles."""
        s = DRIFTS[1]
        found = probe_alarms(s.field, s.fault, s.num_steps, CONTROL_TREND)
        assert found and found[0] >= s.fault.onset and s.fault.engine_factor(found[0]) < 2.0

    def test_healthy_growth_is_quiet(self):
        """Long responses getting less peaked (mean |d| ~5x) and a growing floor: no probe drift."""
        s = SCENARIOS["long-cot-growing"]
        assert probe_alarms(s.field, None, s.num_steps, CONTROL_DRIFT) == []
        assert probe_alarms(s.field, None, s.num_steps, CONTROL_TREND) == []


class TestControlFloor:
    def test_a_precise_engines_probe_does_not_drift(self):
        """A float32 probe at 1e-7 nats tripling is no drift under the control's 1e-3 floor (without the
        floor it alarms, critical); a bf16 level doubling past the floor still does."""
        def alarms(cfg, levels):
            det = DriftDetector(cfg)
            return [a for i, x in enumerate(levels) for a in det.update(i, {K.PROBE_LEVEL: x})]

        fp32 = [1e-7] * 40 + [3e-7] * 20
        assert alarms(CONTROL_DRIFT, fp32) == []
        assert alarms(dataclasses.replace(CONTROL_DRIFT, floor=0.0), fp32)[0].severity == "critical"
        found = alarms(CONTROL_DRIFT, [0.01] * 40 + [0.025] * 20)
        assert found and found[0].severity == "critical" and found[0].details["ratio"] == 2.5

    def test_a_small_probe_is_no_control(self):
        """The sync check's default probe (2 x 16 tokens) gives no control level; 1,024 tokens do."""
        from rlcheck.core.batch import StepBatch

        def probe(n):
            return StepBatch.from_ragged(logp_rollout=[np.full(n, -0.5, np.float32)],
                                         logp_train=[np.full(n, -0.49, np.float32)], request_ids=["p"])

        assert probe_level(probe(32), 0.5) == {}
        assert probe_level(probe(1024), 0.5)[K.PROBE_LEVEL] == pytest.approx(0.01, rel=1e-4)


def residual_alarms(field, fault, num_steps: int) -> list[int]:
    """Observations at which the residual trend warns, on each observation's own batch (no probe)."""
    stream = FieldStream(dataclasses.replace(field, seed=SEED), fault, num_steps)
    det = DriftDetector(RESIDUAL_TREND)
    return [i for i in range(num_steps) if det.update(stream.step(i), step_metrics(stream, i))]


@pytest.mark.slow
class TestResidualTrend:
    """Slow drifts without a probe (issue 37 item 5), on the test seed: the field batches themselves."""

    def test_slow_rise_before_twice_without_a_probe(self):
        """The 5x rise over 450 steps warns after its onset and before the engine's mismatch doubles."""
        s = DRIFTS[1]
        found = residual_alarms(s.field, s.fault, s.num_steps)
        assert found and found[0] >= s.fault.onset and s.fault.engine_factor(found[0]) < 2.0

    def test_fast_rise_is_seen_within_its_ramp(self):
        """The 3.3x rise over 30 steps warns within 30 steps of its onset (the 10-step target needs the probe)."""
        s = DRIFTS[0]
        found = residual_alarms(s.field, s.fault, s.num_steps)
        assert found and s.fault.onset <= found[0] <= s.fault.onset + 30

    def test_healthy_long_cot_growth_is_quiet(self):
        """Long responses getting less peaked (mean |d| ~5x) and a growing floor: no warning without a probe."""
        s = SCENARIOS["long-cot-growing"]
        assert residual_alarms(s.field, None, s.num_steps) == []
