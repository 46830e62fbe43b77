"""Tests of rlcheck.core.run.journal: the durable metrics.jsonl log."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from rlcheck.core.run.journal import FILENAME, Journal, read_jsonl
from rlcheck.errors import RunDirError
from rlcheck.sinks.testing import example_record


def _log_steps(run_dir, records):
    journal = Journal(run_dir)
    for r in records:
        journal.append(r["step"], r)
    journal.close()
    return run_dir / FILENAME


class TestJournal:
    def test_round_trip(self, tmp_path):
        """Records read back equal the records logged, one line each."""
        records = [example_record(s, abs_diff_mean=0.01 * (s + 1), alarms=s) for s in range(3)]
        path = _log_steps(tmp_path, records)
        assert len(path.read_bytes().splitlines()) == 3
        back = read_jsonl(path)
        assert back == records
        assert back.num_skipped == 0

    def test_one_write_and_fsync_per_step(self, tmp_path, monkeypatch):
        """Each step is one os.write of a whole newline-terminated line, fsynced before log returns."""
        journal = Journal(tmp_path)
        calls = []
        real_write, real_fsync = os.write, os.fsync
        monkeypatch.setattr(os, "write", lambda fd, b: calls.append(("write", fd, bytes(b))) or real_write(fd, b))
        monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd, None)) or real_fsync(fd))
        for step in range(2):
            journal.append(step, example_record(step, alarms=1))
        monkeypatch.undo()
        journal.close()
        assert [c[0] for c in calls] == ["write", "fsync", "write", "fsync"]
        lines = [c[2] for c in calls if c[0] == "write"]
        assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)
        assert [json.loads(line)["step"] for line in lines] == [0, 1]

    def test_appends_across_reopen(self, tmp_path):
        """A second journal on the same run directory appends after the first one's lines."""
        _log_steps(tmp_path, [example_record(0)])
        path = _log_steps(tmp_path, [example_record(1)])
        assert [r["step"] for r in read_jsonl(path)] == [0, 1]

    def test_nonfinite_is_strict_json(self, tmp_path):
        """NaN and +-inf become "NaN"/"Infinity"/"-Infinity" on disk and floats again in metrics."""
        record = example_record(0, alarms=1)
        record["metrics"].update(a=math.nan, b=math.inf, c=-math.inf, d=np.float32(0.5))
        record["alarms"][0]["details"]["z"] = math.inf
        path = _log_steps(tmp_path, [record])
        line = path.read_text()
        parsed = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c}"))
        assert parsed["metrics"]["a"] == "NaN" and parsed["metrics"]["c"] == "-Infinity"
        back = read_jsonl(path)[0]
        assert math.isnan(back["metrics"]["a"])
        assert back["metrics"]["b"] == math.inf and back["metrics"]["c"] == -math.inf
        assert back["metrics"]["d"] == 0.5
        assert back["alarms"][0]["details"]["z"] == "Infinity"

    def test_closed_sink_raises(self, tmp_path):
        """Logging after close is a RunDirError, never a write to a recycled descriptor."""
        journal = Journal(tmp_path)
        journal.close()
        journal.close()
        with pytest.raises(RunDirError, match="closed"):
            journal.append(0, example_record(0))

    def test_unwritable_run_dir(self, tmp_path):
        """A run directory that is a file gives a RunDirError naming the path."""
        blocker = tmp_path / "run"
        blocker.write_text("")
        with pytest.raises(RunDirError, match="run"):
            Journal(blocker)

    def test_failed_write_is_truncated_away(self, tmp_path, monkeypatch):
        """A short write (disk full) is a RunDirError naming step and file; the part written is cut
        away, so the file is as before and the next line starts clean."""
        journal = Journal(tmp_path)
        journal.append(0, example_record(0))
        before = (tmp_path / FILENAME).read_bytes()
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, bytes(b)[:10]))
        with pytest.raises(RunDirError, match=r"step 1 to .*metrics\.jsonl.*short write"):
            journal.append(1, example_record(1))
        monkeypatch.undo()
        assert (tmp_path / FILENAME).read_bytes() == before
        journal.append(2, example_record(2))
        journal.close()
        back = read_jsonl(tmp_path / FILENAME)
        assert [r["step"] for r in back] == [0, 2] and back.num_skipped == 0

    def test_reopen_after_torn_line(self, tmp_path):
        """Reopening a file that ends mid-line starts a new line, so only the torn one is lost."""
        path = _log_steps(tmp_path, [example_record(0), example_record(1)])
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 20])
        _log_steps(tmp_path, [example_record(2)])
        back = read_jsonl(path)
        assert [r["step"] for r in back] == [0, 2]
        assert back.num_skipped == 1


class TestReadJsonl:
    def test_skips_truncated_last_line(self, tmp_path):
        """A last line cut short by a crash is skipped and counted; the whole lines survive."""
        path = _log_steps(tmp_path, [example_record(s) for s in range(3)])
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 7])
        back = read_jsonl(path)
        assert [r["step"] for r in back] == [0, 1]
        assert back.num_skipped == 1

    def test_empty_file(self, tmp_path):
        """An empty file reads as no records and nothing skipped."""
        path = tmp_path / FILENAME
        path.write_bytes(b"")
        back = read_jsonl(path)
        assert back == [] and back.num_skipped == 0

    def test_from_offset(self, tmp_path):
        """Reading from a byte offset returns the records after it (what a resumed Monitor replays)."""
        path = _log_steps(tmp_path, [example_record(0)])
        offset = path.stat().st_size
        _log_steps(tmp_path, [example_record(1), example_record(2)])
        assert [r["step"] for r in read_jsonl(path, offset=offset)] == [1, 2]


class TestLoopJournal:
    """Issue 42 item 12: loop.jsonl is appended as metrics.jsonl is: a line a crash cut short stays alone."""

    def test_line_after_a_torn_one_is_kept(self, tmp_path):
        """loop.jsonl ending mid-line (a killed loop): the next line starts on a line of its own, so both
        whole lines read back (the new one glued onto the torn part and was lost before)."""
        from rlcheck.core.run import LOOP_FILE, Run

        (tmp_path / LOOP_FILE).write_text('{"step": 0, "reward_mean": 0.5}\n{"step": 1, "rew')
        run = Run.create(tmp_path)
        run.append_loop({"step": 2, "reward_mean": 0.75})
        run.close()
        assert [line["step"] for line in Run.open(tmp_path).loop()] == [0, 2]

    def test_line_after_the_run_closed(self, tmp_path):
        """The loop writes its halt's line after the halted Monitor closed the run: it is appended."""
        from rlcheck.core.run import Run

        run = Run.create(tmp_path)
        run.append_loop({"step": 0})
        run.close()
        run.append_loop({"step": 1, "halted": True})
        assert [line["step"] for line in Run.open(tmp_path).loop()] == [0, 1]


class TestResumedTrainer:
    """Issue 42 item 12: a trainer resumed from an earlier checkpoint journals its repeated steps again;
    every reader counts each step once (the later record) and the plots do not interleave them."""

    @staticmethod
    def _observe(run_dir, steps, shift):
        import warnings

        from rlcheck import Monitor, MonitorConfig, StepBatch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the resume and "step comes after step" warnings
            with Monitor(MonitorConfig(run_dir=run_dir, sinks=())) as mon:
                for step in steps:
                    rng = np.random.default_rng(step)
                    lr = [-rng.exponential(1.0, 30) for _ in range(8)]
                    lt = [np.minimum(x + rng.normal(0, 1e-3, 30) + shift, 0.0) for x in lr]
                    mon.observe(step, StepBatch.from_ragged(lr, lt, [f"{step}-{i}" for i in range(8)]))
                    mon.run.append_loop({"step": step, "reward_mean": shift})

    def test_repeated_steps_count_once(self, tmp_path):
        """Steps 0-5, then a resume from step 3 to 7: the records, the loop lines, the summary and the
        report's series hold steps 0-7 once each, 3-5 from the resumed process; the summary names them."""
        from rlcheck.core.run import Run
        from rlcheck.report.data import collect
        from rlcheck.report.summary import summarize

        self._observe(tmp_path, range(6), 0.0)
        self._observe(tmp_path, range(3, 8), -0.01)
        assert [r["step"] for r in read_jsonl(tmp_path / FILENAME)] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
        run = Run.open(tmp_path)
        records = run.records()
        assert [r["step"] for r in records] == list(range(8)) and records.superseded == (3, 4, 5)
        assert [r["metrics"]["rlcheck/token/diff_mean"] < -0.005 for r in records] == [False] * 3 + [True] * 5
        assert [(x["step"], x["reward_mean"]) for x in run.loop()] == [(s, 0.0 if s < 3 else -0.01) for s in range(8)]
        summary = summarize(run)
        assert summary["num_steps"] == 8 and summary["superseded_steps"] == [3, 4, 5]
        data = collect(Run.open(tmp_path))
        assert data.steps.tolist() == list(range(8))
