"""Weight versions: each sequence's `weight_version` on the StepBatch, compared by the Monitor with
the trainer's (`observe(..., trainer_version=V)`): a lag past `max_weight_lag` is a critical
`weights` alarm that names the sequences and halts at once; merged across ranks like the statistics."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck import HaltConfig, InputError, MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.run.dump import read_dump
from rlcheck.core.stats import StatsConfig, compute_partial, merge
from rlcheck.core.types import KINDS
from rlcheck.errors import ConfigError
from rlcheck.forensics.diagnose import diagnose


def batch(versions, n_tokens: int = 5, ids=None) -> StepBatch:
    """Matching logprobs for len(versions) sequences (nothing else would alarm)."""
    rng = np.random.default_rng(0)
    logp = [-rng.exponential(1.0, n_tokens) for _ in versions]
    return StepBatch.from_ragged(logp, [x.copy() for x in logp], ids or [f"r{i}" for i in range(len(versions))], weight_version=versions)


class TestStepBatchVersions:
    def test_constructors_take_one_or_one_per_sequence(self):
        assert batch([3, 4]).weight_version.tolist() == [3, 4]
        one = StepBatch.from_padded(np.full((2, 3), -0.5), np.full((2, 3), -0.5), np.ones((2, 3), bool),
                                    ["a", "b"], weight_version=7)
        assert one.weight_version.dtype == np.int64 and one.weight_version.tolist() == [7, 7]
        assert StepBatch.from_ragged([[-1.0]], [[-1.0]], ["a"]).weight_version is None

    @pytest.mark.parametrize(("versions", "match"), [([1], "1 entries for 2 sequences"), ([1, -1], "non-negative"),
                                                     ([1.5, 2.0], "integer")])
    def test_bad_versions_are_input_errors(self, versions, match):
        with pytest.raises(InputError, match=match):
            StepBatch.from_ragged([[-1.0], [-1.0]], [[-1.0], [-1.0]], ["a", "b"], weight_version=versions)

    def test_select_and_concat_keep_them(self):
        b = batch([1, 2, 3])
        assert b.select([2, 0]).weight_version.tolist() == [3, 1]
        joined = StepBatch.concat([b, batch([5], ids=["z"])])
        assert joined.weight_version.tolist() == [1, 2, 3, 5]
        assert StepBatch.concat([b, StepBatch.from_ragged([[-1.0]], [[-1.0]], ["z"])]).weight_version is None

    def test_partials_count_versions_and_merge(self):
        """Per version: the sequence count and its first request ids, summed over ranks."""
        a, b = compute_partial(batch([1, 1, 2])), compute_partial(batch([1], ids=["x"]))
        assert a.versions == {1: (2, ("r0", "r1")), 2: (1, ("r2",))}
        assert merge([a, b]).versions == {1: (3, ("r0", "r1", "x")), 2: (1, ("r2",))}
        assert compute_partial(batch([4], n_tokens=0)).versions == {4: (1, ("r0",))}  # a token-less step too


class TestMonitorWeights:
    def test_stale_sequences_alarm_and_halt_at_once(self, tmp_path):
        """Trainer at version 5, two sequences from version 4: a critical weights alarm naming them, the
        halt at this step (patience aside), the dump carrying the versions; diagnose says weights."""
        mon = Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), halt=HaltConfig(patience=3)))
        clean = mon.observe(0, batch([5, 5, 5]), trainer_version=5)
        assert clean.metrics[K.WEIGHTS_MAX_LAG] == 0 and clean.metrics[K.WEIGHTS_STALE_COUNT] == 0
        assert not clean.alarms
        with pytest.raises(MismatchHalt) as halt:
            mon.observe(1, batch([4, 5, 4]), trainer_version=5)
        mon.close()
        (alarm,) = halt.value.report.alarms
        assert (alarm.kind, alarm.severity, alarm.metric) == ("weights", "critical", K.WEIGHTS_MAX_LAG)
        assert alarm.details["request_ids"] == ["r0", "r2"] and alarm.details["stale"] == 2
        assert "1 version(s) behind" in alarm.message
        rows, _ = read_dump(halt.value.dump_dir)
        assert [r["weight_version"] for r in rows] == [4, 5, 4]
        verdict = diagnose(tmp_path).verdict
        assert verdict.cause == "weights_out_of_sync" and verdict.affected_steps == [1]
        assert verdict.affected_request_ids == ["r0", "r2"]

    def test_allowed_lag_and_missing_versions_are_quiet(self, tmp_path):
        """max_weight_lag=1 lets a lag of 1 pass (2 does not); no versions or no trainer_version: no check."""
        mon = Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), max_weight_lag=1, halt=HaltConfig(enabled=False)))
        assert not mon.observe(0, batch([4, 5]), trainer_version=5).alarms
        assert [a.kind for a in mon.observe(1, batch([3, 5]), trainer_version=5).alarms] == ["weights"]
        report = mon.observe(2, StepBatch.from_ragged([[-1.0]], [[-1.0]], ["a"]), trainer_version=5)
        assert not report.alarms and K.WEIGHTS_MAX_LAG not in report.metrics
        assert K.WEIGHTS_MAX_LAG not in mon.observe(3, batch([1])).metrics
        mon.close()

    def test_newer_than_the_trainer_is_a_counting_error(self, tmp_path):
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), halt=HaltConfig(enabled=False))) as mon:
            (alarm,) = mon.observe(0, batch([6]), trainer_version=5).alarms
        assert alarm.kind == "weights" and "newer than the trainer's 5" in alarm.message

    def test_bad_arguments(self, tmp_path):
        with pytest.raises(ConfigError, match="max_weight_lag"):
            MonitorConfig(run_dir=tmp_path, max_weight_lag=-1)
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=())) as mon, pytest.raises(InputError, match="trainer_version"):
            mon.observe(0, batch([1]), trainer_version=-2)

    def test_weights_is_a_kind_that_halting_can_leave_out(self, tmp_path):
        """Without "weights" in HaltConfig.kinds the alarm is logged and the run goes on."""
        kinds = tuple(k for k in KINDS if k != "weights")
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), halt=HaltConfig(kinds=kinds))) as mon:
            report = mon.observe(0, batch([1, 2]), trainer_version=2)
        assert not report.halted and [a.kind for a in report.alarms] == ["weights"]


def test_stats_config_unchanged_by_versions():
    """The versions ride beside the statistics: the metrics of a batch are the same with or without."""
    from rlcheck.core.stats import compute

    with_v, _ = compute(batch([1, 2]), StatsConfig())
    fields = {k: v for k, v in batch([1, 2]).__dict__.items() if k != "device_tensors"}  # not an init field
    without, _ = compute(StepBatch(**{**fields, "weight_version": None}), StatsConfig())
    assert with_v == without
