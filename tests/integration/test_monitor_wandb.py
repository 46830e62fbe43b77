"""The Monitor with the W&B sink, offline, read back from disk: the logged values, what happens when
W&B fails (at init, mid-run), redaction; and with a user's own sink."""

from __future__ import annotations

import json

import pytest

from rlcheck import HaltConfig, MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.run.dump import read_dump
from rlcheck.core.run.journal import read_jsonl
from rlcheck.sinks import SinkWarning, WandbConfig, WandbSink
from rlcheck.sinks.testing import RecordingSink, read_offline_run
from rlcheck.sinks.wandb import (
    OFFENDER_COLUMNS,
    OFFENDERS_KEY,
    RUN_ID_FILE,
    SUMMARY_ALARMS_TOTAL,
    SUMMARY_SKIPPED,
    SUMMARY_WORST_STEP,
)
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

SMALL = SyntheticConfig(num_sequences=400, mean_length=20, corrupt_every_step=1)
CLEAN = SyntheticConfig(num_sequences=64, mean_length=20)
NO_HALT = HaltConfig(enabled=False)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Offline, silent wandb writing under tmp_path; returns the wandb module."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return wandb


def history(run_dir, offline_dir=None) -> dict[int, dict]:
    """step -> logged row of the single offline run under run_dir/wandb (or of `offline_dir`)."""
    if offline_dir is None:
        (offline_dir,) = list((run_dir / "wandb").glob("offline-run-*"))
    records = read_offline_run(offline_dir)
    assert [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] == [0]  # finished
    return {r["history"]["step"].get("num", 0): r["history"]["item"] for r in records if r["type"] == "history"}


@pytest.mark.slow
class TestMonitorWandb:
    def test_offline_run_matches_jsonl(self, tmp_path, offline):
        """Every step's metrics reach the offline W&B run under run_dir/wandb with the JSONL's values,
        and each alarm becomes an alert (halting off: the recurrence escalates step 1's to critical)."""
        run_dir = tmp_path / "run"
        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "wandb"), halt=NO_HALT)) as mon:
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
        assert len(alerts) == len(alarms)
        # early divergence at step 0 (warn), its recurrence at step 1 (critical); step 2's corrupted
        # sequence does not meet the catastrophic rule, so no alarm
        assert [(a["step"], a["severity"]) for a in alarms] == [(0, "warn"), (1, "critical")]
        assert sum("diverge from their first tokens" in a["text"] for a in alerts) == 2

    def test_user_sink_receives_records(self, tmp_path):
        """A Sink instance in MonitorConfig.sinks gets every step's record."""
        sink = RecordingSink()
        with Monitor(MonitorConfig(run_dir=tmp_path / "r", sinks=(sink,))) as mon:
            mon.observe(0, synthetic_batch(SMALL, 0))
        assert sink.records[0]["step"] == 0 and sink.closed


@pytest.mark.slow
class TestMonitorWandbFailures:
    def test_init_fails(self, tmp_path, offline, monkeypatch, capsys):
        """wandb.init raising: one SinkWarning, and the run goes on with every step in JSONL and on the console."""

        def refuse(**kwargs):
            raise RuntimeError("wandb.init: network unreachable")

        monkeypatch.setattr(offline, "init", refuse)
        message = six_steps(tmp_path / "run", capsys)
        assert "continuing without W&B" in message and "network unreachable" in message
        assert not (tmp_path / "run" / "wandb").exists()

    def test_log_fails_mid_run(self, tmp_path, offline, monkeypatch, capsys):
        """The real offline run's log raising from step 3 of 6: one SinkWarning (after its retries), all 6
        steps in JSONL and on the console, and the W&B run is still finished at close, holding steps 0-2
        and the count of the steps it missed in its summary."""

        def break_log_at_step_3(mon):
            (sink,) = [s for s in mon.sinks.sinks if isinstance(s, WandbSink)]
            real_log = sink.run.log

            def log(row, step=None, **kwargs):
                if step >= 3:
                    raise RuntimeError("W&B backend gone")
                return real_log(row, step=step, **kwargs)

            monkeypatch.setattr(sink.run, "log", log)

        message = six_steps(tmp_path / "run", capsys, break_log_at_step_3)
        assert "did not take step 3's row after 4 tries" in message and "W&B backend gone" in message
        assert sorted(history(tmp_path / "run")) == [0, 1, 2]
        assert summary(tmp_path / "run")[SUMMARY_SKIPPED] == 3

    def test_transient_log_failure_is_retried(self, tmp_path, offline, monkeypatch, recwarn):
        """log() raising once at step 3 (a network blip) is tried again: every step reaches the W&B run,
        no warning, the sink stays (it was dropped for the rest of the run before)."""
        run_dir = tmp_path / "run"
        cfg = MonitorConfig(run_dir=run_dir, sinks=("jsonl", "wandb"), halt=NO_HALT, wandb=WandbConfig(retry_wait_s=0.0))
        with Monitor(cfg) as mon:
            (sink,) = [s for s in mon.sinks.sinks if isinstance(s, WandbSink)]
            real_log, failed = sink.run.log, []

            def log(row, step=None, **kwargs):
                if step == 3 and not failed:
                    failed.append(step)
                    raise ConnectionError("W&B: connection reset")
                return real_log(row, step=step, **kwargs)

            monkeypatch.setattr(sink.run, "log", log)
            for step in range(6):
                mon.observe(step, synthetic_batch(CLEAN, step))
            assert sink in mon.sinks.sinks
        assert failed == [3] and sorted(history(run_dir)) == list(range(6))
        assert not [w for w in recwarn if issubclass(w.category, SinkWarning)]


@pytest.mark.slow
class TestMonitorWandbResume:
    def test_resume_continues_the_same_run_and_its_totals(self, tmp_path, offline):
        """A Monitor resuming the run dir logs to the same W&B run id (offline: a second part of it), and
        its summary's alarms_total and worst step count both processes' steps (the new process's
        alone before, from 0)."""
        run_dir = tmp_path / "run"
        for steps in (range(0, 3), range(3, 5)):
            with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "wandb"), halt=NO_HALT)) as mon:
                for step in steps:
                    b = synthetic_batch(CLEAN, step)
                    if step in (1, 3):  # every token 2 nats off: a hard-limit alarm (halting off)
                        b = StepBatch.from_packed(b.logp_rollout, b.logp_train - 2.0, b.cu_seqlens, b.request_ids)
                    mon.observe(step, b)
        parts = sorted((run_dir / "wandb").glob("offline-run-*"))
        # offline-run-<time>-<id>, "-1" appended to the second when both started within the same second
        run_id = (run_dir / "wandb" / RUN_ID_FILE).read_text().strip()
        assert len(parts) == 2 and [p.name.split("-")[3] for p in parts] == [run_id, run_id]  # one run id
        records = read_jsonl(run_dir / "metrics.jsonl")
        alarms = sum(len(r["alarms"]) for r in records)
        worst = max(records, key=lambda r: r["metrics"][K.ABS_DIFF_MEAN])
        assert alarms > len(records[3]["alarms"]) > 0  # both processes alarmed
        last = summary(run_dir, parts[1])
        assert last[SUMMARY_ALARMS_TOTAL] == alarms
        assert last.get(SUMMARY_WORST_STEP, worst["step"]) == worst["step"]
        assert sorted(history(run_dir, parts[1])) == [3, 4]


def summary(run_dir, offline_dir=None) -> dict:
    """The last value of each summary key of an offline run under run_dir/wandb (the only one by default)."""
    if offline_dir is None:
        (offline_dir,) = list((run_dir / "wandb").glob("offline-run-*"))
    out: dict = {}
    for r in read_offline_run(offline_dir):
        if r["type"] == "summary":
            out.update(r["summary"].get("update") or {})
    return out


def six_steps(run_dir, capsys, on_start=None) -> str:
    """Six clean steps through the jsonl, console and wandb sinks (`on_start(mon)` first); checks that all
    six reached metrics.jsonl and the console, and returns the one SinkWarning's message."""
    with pytest.warns(SinkWarning) as caught:
        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "console", "wandb"), halt=NO_HALT)) as mon:
            if on_start is not None:
                on_start(mon)
            for step in range(6):
                mon.observe(step, synthetic_batch(CLEAN, step))
    (message,) = [str(w.message) for w in caught if issubclass(w.category, SinkWarning)]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(6))
    out = capsys.readouterr().out
    assert all(f"step {s} " in out for s in range(6))
    return message


@pytest.mark.slow
class TestMonitorWandbRedact:
    SECRET = "SECRET-PROMPT-TEXT"

    def _batch(self, step):
        b = synthetic_batch(CLEAN, step)
        n = b.num_sequences
        return StepBatch.from_packed(
            b.logp_rollout, b.logp_train - 2.0, b.cu_seqlens, b.request_ids, tokens=b.tokens,
            prompt_tokens=[[1, 2, 3]] * n,
            meta={"prompt_text": [f"{self.SECRET}-{i}" for i in range(n)], "vllm_request_id": [f"v{i}" for i in range(n)],
                  "slot": list(range(n))},
        )

    def _run(self, run_dir, redact):
        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "wandb"), redact=redact)) as mon:
            with pytest.raises(MismatchHalt) as info:
                mon.observe(0, self._batch(0))
        return info.value.dump_dir

    def test_no_text_or_tokens_anywhere(self, tmp_path, offline):
        """With redact=True no file under the run dir (dump, JSONL, state, the W&B run) holds the prompt
        text, the dump has no token ids, and the W&B offenders table has only id and number columns;
        without redaction the same scan finds the text in the dump."""
        rows, meta = read_dump(self._run(tmp_path / "red", redact=True))
        assert meta["redacted"] and meta["redacted_columns"] == ["prompt_text"]
        assert all(r["prompt_tokens"] is None and r["response_tokens"] is None for r in rows)
        assert "prompt_text" not in rows[0] and rows[0]["vllm_request_id"] == "v0" and rows[0]["slot"] == 0
        holding = [p for p in (tmp_path / "red").rglob("*") if p.is_file() and self.SECRET.encode() in p.read_bytes()]
        assert holding == []
        row = history(tmp_path / "red")[0]
        table = json.loads((next((tmp_path / "red" / "wandb").glob("offline-run-*")) / "files"
                            / row[OFFENDERS_KEY + ".path"]).read_text())
        assert table["columns"] == list(OFFENDER_COLUMNS)
        assert not [c for c in table["columns"] if any(w in c for w in ("token", "text", "prompt", "response"))]

        rows, _ = read_dump(self._run(tmp_path / "plain", redact=False))
        assert rows[0]["prompt_text"] == f"{self.SECRET}-0" and rows[0]["prompt_tokens"].tolist() == [1, 2, 3]
        assert any(self.SECRET.encode() in p.read_bytes() for p in (tmp_path / "plain" / "dumps").rglob("*.parquet"))
