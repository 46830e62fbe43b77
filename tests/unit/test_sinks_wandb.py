"""Tests of rlcheck.sinks.wandb: W&B logging, checked against a real offline run read back from disk."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from rlcheck.core import histogram as H
from rlcheck.core import metrics as K
from rlcheck.sinks import FanOut, SinkWarning, WandbConfig, WandbSink, make_sinks
from rlcheck.sinks.testing import example_record, read_offline_run
from rlcheck.sinks.wandb import HIST_KEY, OFFENDER_COLUMNS, OFFENDERS_KEY, histogram_args

S = "rlcheck/summary/"


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """Offline, silent wandb with every directory it writes under tmp_path."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in [("WANDB_DIR", ""), ("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_CONFIG_DIR", "config"), ("WANDB_ARTIFACT_DIR", "artifacts")]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    return tmp_path


def _inspect(run_dir) -> list[dict]:
    """The records of an offline run's .wandb log (skips where wandb cannot read runs back)."""
    try:
        return read_offline_run(run_dir)
    except RuntimeError as exc:
        pytest.skip(str(exc))


class _FakeRun:
    """Records what a sink does to a run; `alert` fails to mimic a mode without alerts."""

    def __init__(self):
        self.rows, self.summary, self.finished = [], {}, False

    def log(self, row, step):
        self.rows.append((step, row))

    def alert(self, **kwargs):
        raise RuntimeError("alerts need a W&B server")

    def finish(self):
        self.finished = True


class TestWandbConfig:
    def test_defaults(self):
        """The defaults are valid and leave the mode to wandb."""
        cfg = WandbConfig()
        assert cfg.project == "rlcheck" and cfg.mode is None and cfg.table_every == 1

    @pytest.mark.parametrize(
        "kwargs", [{"project": ""}, {"mode": "cloud"}, {"table_every": 0}, {"entity": ""}, {"tags": "a"}]
    )
    def test_invalid(self, kwargs):
        """Out-of-range fields raise ValueError."""
        with pytest.raises(ValueError):
            WandbConfig(**kwargs)

    def test_tags_become_tuple(self):
        """A list of tags is stored as a tuple, so the config stays hashable."""
        assert hash(WandbConfig(tags=["a", "b"])) and WandbConfig(tags=["a"]).tags == ("a",)


class TestHistogramArgs:
    def test_dense_span_with_open_last_bin(self):
        """Nonzero bins become a contiguous span; the open last bin closes at twice its left edge."""
        last = H.NUM_ABS_BINS - 1
        counts, edges = histogram_args({"bins": [last - 2, last], "counts": [4, 1]})
        assert counts.tolist() == [4, 0, 1]
        assert edges.tolist() == [*H.ABS_EDGES[last - 2 :].tolist(), 2 * H.ABS_EDGES[last]]

    def test_wide_span_is_merged(self):
        """A span wider than wandb's 512 bins is merged in pairs, keeping the total and the range."""
        counts, edges = histogram_args({"bins": [0, 600], "counts": [5, 7]})
        assert len(counts) <= 512 and len(edges) == len(counts) + 1
        assert counts.sum() == 12 and edges[0] == 0.0 and edges[-1] == H.ABS_EDGES[601]
        assert np.all(np.diff(edges) > 0)

    def test_empty(self):
        """No counted tokens give no histogram."""
        assert histogram_args({"bins": [], "counts": []}) is None and histogram_args(None) is None


class TestWandbSink:
    def test_user_run_alert_failure_and_summary(self, tmp_path):
        """With the user's run: rows logged, one warning when alerts fail, summary kept, run left open."""
        pytest.importorskip("wandb")
        run = _FakeRun()
        sink = WandbSink(tmp_path, WandbConfig(table_every=2), run=run)
        with pytest.warns(SinkWarning, match="alerts") as caught:
            for step, (mean, n) in enumerate([(0.01, 0), (0.05, 2), (0.02, 1)]):
                sink.log(step, example_record(step, abs_diff_mean=mean, alarms=n))
        sink.close()
        assert len(caught) == 1 and not run.finished
        assert [s for s, _ in run.rows] == [0, 1, 2]
        assert [r[K.ALARM_COUNT] for _, r in run.rows] == [0, 2, 1]
        assert [OFFENDERS_KEY in r for _, r in run.rows] == [True, False, True]
        assert run.summary[S + "worst_step"] == 1 and run.summary[S + "worst_abs_diff_mean"] == 0.05
        assert run.summary[S + "alarms/threshold"] == 2 and run.summary[S + "alarms/robust_z"] == 1
        assert run.summary[S + "alarms_total"] == 3 and "step 2" in run.summary[S + "last_alarm"]

    @pytest.mark.slow
    def test_offline_run_reads_back(self, offline_wandb):
        """An offline run holds the per-step scalars, table, histogram, alert and summary counts."""
        run_dir = offline_wandb
        means = [0.01, 0.04, 0.02]
        sink = WandbSink(run_dir, WandbConfig(name="t"))
        for step, mean in enumerate(means):
            sink.log(step, example_record(step, abs_diff_mean=mean, alarms=int(step == 1)))
        sink.close()

        (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        records = _inspect(wandb_file.parent)
        history = {r["history"]["step"].get("num", 0): r["history"]["item"] for r in records if r["type"] == "history"}
        assert sorted(history) == [0, 1, 2]
        for step, mean in enumerate(means):
            row = history[step]
            assert row[K.ABS_DIFF_MEAN] == pytest.approx(mean)
            assert row[K.MULT_PROB_ERROR] == pytest.approx(1 + mean)
            assert row[K.ALARM_COUNT] == int(step == 1)
            assert row[OFFENDERS_KEY + "._type"] == "table-file" and row[OFFENDERS_KEY + ".nrows"] == 2
            assert row[HIST_KEY + "._type"] == "histogram"
            assert sum(row[HIST_KEY + ".values"]) == 1000
            assert row[HIST_KEY + ".bins"][0] == pytest.approx(H.ABS_EDGES[300])

        table = json.loads((wandb_file.parent / "files" / history[2][OFFENDERS_KEY + ".path"]).read_text())
        assert table["columns"] == list(OFFENDER_COLUMNS)
        assert [row[0] for row in table["data"]] == ["req-2-0", "req-2-1"]

        alerts = [r["alert"] for r in records if r["type"] == "alert"]
        assert [a["level"] for a in alerts] == ["ERROR"] and "step 1" in alerts[0]["text"]

        summary = {}
        for r in records:
            if r["type"] == "summary":
                summary.update(r["summary"].get("update", {}))
        assert summary[S + "alarms/threshold"] == 1 and summary[S + "alarms_total"] == 1
        assert summary[S + "worst_step"] == 1 and summary[S + "worst_abs_diff_mean"] == pytest.approx(0.04)
        assert [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] == [0]


class _FlakyRun(_FakeRun):
    """A run whose `log` raises while `failing` is true (a W&B backend that blips or goes away)."""

    def __init__(self, failing):
        super().__init__()
        self.failing, self.calls = failing, 0

    def log(self, row, step):
        self.calls += 1
        if self.failing(step, self.calls):
            raise ConnectionError("W&B backend unreachable")
        super().log(row, step)

    def alert(self, **kwargs):
        pass


class TestWandbSinkFailures:
    """Issue 42 item 11: a failed log() is retried, then degraded with one warning; the totals survive a resume."""

    def _sink(self, tmp_path, run, retries=3):
        pytest.importorskip("wandb")
        return WandbSink(tmp_path, WandbConfig(log_retries=retries, retry_wait_s=0.0), run=run)

    def test_transient_failure_retried(self, tmp_path):
        """log() failing once: retried at once, every step logged, no warning, the sink stays."""
        run = _FlakyRun(lambda step, calls: calls == 2)
        sink = self._sink(tmp_path, run)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fan = FanOut([sink])
            for step in range(4):
                fan.log(step, example_record(step))
        assert [s for s, _ in run.rows] == [0, 1, 2, 3] and fan.sinks == (sink,)

    def test_outage_degrades_with_one_warning_and_recovers(self, tmp_path):
        """log() failing at steps 2-4: one SinkWarning (after 1 + 3 tries at step 2, one try a step after),
        steps 2-4 skipped and counted in the summary, the sink kept, step 5 on logged again."""
        run = _FlakyRun(lambda step, calls: 2 <= step <= 4)
        sink = self._sink(tmp_path, run)
        fan = FanOut([sink])
        with pytest.warns(SinkWarning, match="did not take step 2's row after 4 tries") as caught:
            for step in range(7):
                fan.log(step, example_record(step))
        assert len(caught) == 1 and fan.sinks == (sink,)
        assert [s for s, _ in run.rows] == [0, 1, 5, 6] and run.calls == 2 + 4 + 1 + 1 + 2
        assert run.summary[S + "skipped_steps"] == 3

    def test_totals_carried_over_a_resume(self, tmp_path):
        """state_dict / load_state_dict carry alarms by kind and the worst step into a new sink (a resumed
        run's summary goes on from them, not from 0)."""
        first = self._sink(tmp_path, _FakeRun())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first.log(0, example_record(0, abs_diff_mean=0.05, alarms=2))
        run = _FakeRun()
        second = self._sink(tmp_path, run)
        second.load_state_dict(json.loads(json.dumps(FanOut([first]).state_dict()))["WandbSink"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second.log(1, example_record(1, abs_diff_mean=0.01, alarms=1))
        assert run.summary[S + "alarms_total"] == 3 and S + "worst_step" not in run.summary


class TestMakeSinksWandb:
    def test_init_failure_skips_wandb(self, tmp_path, monkeypatch):
        """wandb.init raising gives one SinkWarning and a FanOut without it ("jsonl" is the Run's journal,
        not a sink)."""
        wandb = pytest.importorskip("wandb")

        def refuse(**kwargs):
            raise RuntimeError("no network")

        monkeypatch.setattr(wandb, "init", refuse)
        with pytest.warns(SinkWarning, match="no network") as caught:
            fan = make_sinks(["jsonl", "wandb"], tmp_path, WandbConfig(mode="online"))
        assert len(caught) == 1
        assert isinstance(fan, FanOut) and fan.sinks == ()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fan.log(0, example_record(0))
            fan.close()


class TestMonitorCarriesWandbTotals:
    """Issue 42 item 11, through the Monitor: the sink's totals go into state.json and a resumed Monitor's
    sink continues them (a fake run stands for W&B; the real offline run: tests/integration/test_monitor_wandb.py)."""

    def test_resumed_monitor_continues_totals(self, tmp_path):
        pytest.importorskip("wandb")
        from rlcheck import HaltConfig, Monitor, MonitorConfig, StepBatch
        from rlcheck.synthetic import SyntheticConfig, synthetic_batch

        clean, run_dir = SyntheticConfig(num_sequences=32, mean_length=12), tmp_path / "run"
        runs = []
        for steps in (range(0, 3), range(3, 5)):
            run = _FlakyRun(lambda step, calls: step == 2)  # step 2 never reaches W&B: counted as skipped
            runs.append(run)
            cfg = MonitorConfig(run_dir=run_dir, sinks=("jsonl", "wandb"), halt=HaltConfig(enabled=False),
                                resume=bool(runs[:-1]), wandb=WandbConfig(retry_wait_s=0.0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Monitor(cfg, wandb_run=run) as mon:
                    for step in steps:
                        b = synthetic_batch(clean, step)
                        if step in (1, 3):  # every token 2 nats off: a hard-limit alarm (halting off)
                            b = StepBatch.from_packed(b.logp_rollout, b.logp_train - 2.0, b.cu_seqlens,
                                                      b.request_ids)
                        mon.observe(step, b)
            alarms_so_far = sum(mon.alarm_counts.values())
        first, second = runs
        assert first.summary[S + "worst_step"] == 1 and first.summary[S + "skipped_steps"] == 1
        assert alarms_so_far > first.summary[S + "alarms_total"] > 0
        # the second process's summary counts both processes' alarms and the first one's skipped step
        assert second.summary[S + "alarms_total"] == alarms_so_far
        assert second.summary[S + "skipped_steps"] == 1
        assert [s for s, _ in second.rows] == [3, 4]
