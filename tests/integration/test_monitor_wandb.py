"""The Monitor with the W&B sink, offline, read back from disk; and with a user's own sink."""

from __future__ import annotations

import pytest

from rlcheck import Monitor, MonitorConfig
from rlcheck import metrics as K
from rlcheck.sinks import read_jsonl
from rlcheck.sinks.testing import RecordingSink, read_offline_run
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

SMALL = SyntheticConfig(num_sequences=400, mean_length=20, corrupt_every_step=1)


@pytest.mark.slow
class TestMonitorWandb:
    def test_offline_run_matches_jsonl(self, tmp_path, monkeypatch):
        """Every step's metrics reach the offline W&B run under run_dir/wandb with the JSONL's values,
        and each alarm becomes an alert."""
        pytest.importorskip("wandb")
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
            monkeypatch.setenv(var, str(tmp_path / var.lower()))
        run_dir = tmp_path / "run"
        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "wandb"))) as mon:
            for step in range(3):
                mon.observe(step, synthetic_batch(SMALL, step))
        (offline,) = list((run_dir / "wandb").glob("offline-run-*"))
        records = read_offline_run(offline)
        logged = {
            r["history"]["step"].get("num", 0): r["history"]["item"][K.ABS_DIFF_MEAN]
            for r in records if r["type"] == "history"
        }
        jsonl = {r["step"]: r["metrics"][K.ABS_DIFF_MEAN] for r in read_jsonl(run_dir / "metrics.jsonl")}
        assert logged.keys() == jsonl.keys() == {0, 1, 2}
        for step, value in jsonl.items():
            assert logged[step] == pytest.approx(value, rel=1e-12)
        alerts = [r["alert"] for r in records if r["type"] == "alert"]
        alarms = [a for r in read_jsonl(run_dir / "metrics.jsonl") for a in r["alarms"]]
        assert len(alerts) == len(alarms) >= 3  # an early-divergence warning every step, at least
        assert sum("diverge from their first tokens" in a["text"] for a in alerts) == 3

    def test_user_sink_receives_records(self, tmp_path):
        """A Sink instance in MonitorConfig.sinks gets every step's record."""
        sink = RecordingSink()
        with Monitor(MonitorConfig(run_dir=tmp_path / "r", sinks=(sink,))) as mon:
            mon.observe(0, synthetic_batch(SMALL, 0))
        assert sink.records[0]["step"] == 0 and sink.closed
