"""Crash safety of the Monitor, in process: resume after a process stopped between its writes, the
evidence on halt, atomic dumps, and a run directory that is full at start or fills mid-run.
(The same with real SIGKILLs of a subprocess: tests/integration/test_crash_safety.py.)"""

from __future__ import annotations

import errno
import json
import os
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlcheck import HaltConfig, MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core.run import files as R
from rlcheck.core.run.dump import read_dump, write_dump
from rlcheck.core.run.journal import read_jsonl
from rlcheck.errors import RecordWriteError, RunDirError
from rlcheck.sinks.testing import RecordingSink
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

CFG = SyntheticConfig(num_sequences=32, mean_length=20, spike_every=4, spike_phase=1, spike_start=14, spike_scale=4.0)
"""Spikes every 4th step: robust-z alarms from step 33 and a periodic one by step 57."""
NO_HALT = HaltConfig(enabled=False)


class _Died(BaseException):
    """Stands in for the process dying at the patched point (not an Exception: nothing catches it)."""


def mon(run_dir, *sinks, **kw):
    return Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", *sinks), **kw))


def bad_batch(step: int, **kw) -> StepBatch:
    """A step far past the hard limit on mean |d| (halts by default)."""
    b = synthetic_batch(CFG, step)
    return StepBatch.from_packed(b.logp_rollout, b.logp_train - 2.0, b.cu_seqlens, b.request_ids, **kw)


def steps_of(run_dir) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def state_of(run_dir) -> dict:
    return json.loads((run_dir / "state.json").read_text())


class TestResumeAfterCrash:
    def test_line_without_state_is_replayed(self, tmp_path, monkeypatch):
        """A process that died after step 45's line but before its state leaves a run that resumes
        at step 46 with the detectors of an uninterrupted run, every step logged once."""
        ref = mon(tmp_path / "ref", halt=NO_HALT)
        for s in range(60):
            ref.observe(s, synthetic_batch(CFG, s))
        assert {"robust_z", "periodic"} <= set(ref.alarm_counts)
        first = mon(tmp_path / "run", halt=NO_HALT)
        for s in range(45):
            first.observe(s, synthetic_batch(CFG, s))
        monkeypatch.setattr(R, "atomic_write_json", _raise(_Died()))
        with pytest.raises(_Died):
            first.observe(45, synthetic_batch(CFG, 45))
        monkeypatch.undo()
        first.close()  # the process is gone, and its lock on the run dir with it
        assert state_of(tmp_path / "run")["last_step"] == 44 and steps_of(tmp_path / "run")[-1] == 45
        with pytest.warns(UserWarning, match=r"held step\(s\) \[45\].*resume after step 45"):
            second = mon(tmp_path / "run", halt=NO_HALT)
        assert second.last_step == 45
        for s in range(46, 60):
            second.observe(s, synthetic_batch(CFG, s))
        assert steps_of(tmp_path / "run") == list(range(60))
        run, want = state_of(tmp_path / "run"), state_of(tmp_path / "ref")
        assert (run["detectors"], run["alarm_counts"]) == (want["detectors"], want["alarm_counts"])

    def test_empty_step_replayed_as_empty(self, tmp_path, monkeypatch):
        """An empty step (every token masked) logged just before the process died is replayed as
        empty: the resumed run's halting streak and detectors equal an uninterrupted run's."""
        from rlcheck.core.detect import Alarm

        def observe(m, s):
            b = synthetic_batch(CFG, s)
            mask = None if s != 40 else np.zeros(b.num_tokens, dtype=bool)
            b = StepBatch.from_packed(b.logp_rollout, b.logp_train, b.cu_seqlens, b.request_ids, mask=mask)
            outside = [Alarm("signature", "guard/violations", s, "critical", "x")] if s == 39 else []
            m.observe(s, b, alarms=outside)

        warnings.simplefilter("ignore")  # the empty step's and the resume's warnings
        halt = HaltConfig(patience=3)
        ref = mon(tmp_path / "ref", halt=halt)
        for s in range(41):
            observe(ref, s)
        first = mon(tmp_path / "run", halt=halt)
        for s in range(40):
            observe(first, s)
        monkeypatch.setattr(R, "atomic_write_json", _raise(_Died()))
        with pytest.raises(_Died):
            observe(first, 40)
        monkeypatch.undo()
        first.close()
        second = mon(tmp_path / "run", halt=halt)
        assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[40]["empty"] is True
        assert (second.last_step, second.streak) == (40, ref.streak) and ref.streak == 1
        assert second.state_dict()["detectors"] == ref.state_dict()["detectors"]

    def test_first_step(self, tmp_path, monkeypatch):
        """Dying after the very first line still resumes after it: a fresh state is saved before that line."""
        first = mon(tmp_path)
        real_log = first.sinks.log

        def log_then_die_on_save(step, record):
            real_log(step, record)
            monkeypatch.setattr(R, "atomic_write_json", _raise(_Died()))

        first.sinks.log = log_then_die_on_save
        with pytest.raises(_Died):
            first.observe(0, synthetic_batch(CFG, 0))
        monkeypatch.undo()
        first.close()
        assert state_of(tmp_path)["last_step"] is None and steps_of(tmp_path) == [0]
        with pytest.warns(UserWarning, match=r"held step\(s\) \[0\]"):
            assert mon(tmp_path).last_step == 0

    def test_repeated_step_after_catch_up_warns(self, tmp_path, monkeypatch):
        """A trainer that observes the replayed step again gets the repeated-step warning; both lines stay."""
        first = mon(tmp_path)
        first.observe(0, synthetic_batch(CFG, 0))
        monkeypatch.setattr(R, "atomic_write_json", _raise(_Died()))
        with pytest.raises(_Died):
            first.observe(1, synthetic_batch(CFG, 1))
        monkeypatch.undo()
        first.close()
        with pytest.warns(UserWarning, match="held step"):
            second = mon(tmp_path)
        with pytest.warns(UserWarning, match="step 1 comes after step 1"):
            second.observe(1, synthetic_batch(CFG, 1))
        assert steps_of(tmp_path) == [0, 1, 1]

    def test_torn_last_line(self, tmp_path):
        """A line cut short after the last state save is skipped with one warning; the run resumes."""
        first = mon(tmp_path)
        for s in range(2):
            first.observe(s, synthetic_batch(CFG, s))
        first.close()
        with open(tmp_path / "metrics.jsonl", "ab") as f:
            f.write(b'{"step":2,"metrics":{"rlcheck/tok')
        with pytest.warns(UserWarning, match=r"held step\(s\) \[\].*1 line\(s\) cut short"):
            second = mon(tmp_path)
        assert second.last_step == 1
        second.observe(2, synthetic_batch(CFG, 2))
        records = read_jsonl(tmp_path / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2] and records.num_skipped == 1

    def test_clean_resume_warns_once(self, tmp_path):
        """A run that was closed normally resumes with one warning naming the step, nothing replayed."""
        first = mon(tmp_path)
        first.observe(0, synthetic_batch(CFG, 0))
        first.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert mon(tmp_path).last_step == 0
        assert len(caught) == 1 and "resume after step 0" in str(caught[0].message)
        assert "held step" not in str(caught[0].message)

    def test_partial_dump_removed_at_start(self, tmp_path):
        """A hidden temp dir a crash left in dumps/ is deleted by the next Monitor; real dumps stay."""
        m = mon(tmp_path)
        m.dump(3, synthetic_batch(CFG, 3))
        m.close()
        (tmp_path / "dumps" / ".step_000004.x1y2").mkdir()
        (tmp_path / "dumps" / ".step_000004.x1y2" / "sequences.parquet").write_bytes(b"PAR1")
        mon(tmp_path)
        assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["step_000003"]


class TestHaltEvidence:
    def test_everything_on_disk_when_caught(self, tmp_path):
        """When MismatchHalt is caught, the dump reads back, state.json and metrics.jsonl hold the halting step."""
        m = mon(tmp_path)
        m.observe(0, synthetic_batch(CFG, 0))
        try:
            m.observe(1, bad_batch(1))
        except MismatchHalt as halt:
            assert halt.dump_dir and halt.problems == ()
            table = pq.read_table(os.path.join(halt.dump_dir, "sequences.parquet"))
            assert table.num_rows == CFG.num_sequences
            assert json.loads((tmp_path / "dumps" / "step_000001" / "meta.json").read_text())["step"] == 1
            assert state_of(tmp_path)["last_step"] == 1
            assert steps_of(tmp_path) == [0, 1]
            assert [p.name for p in (tmp_path / "dumps").iterdir()] == ["step_000001"]
        else:
            pytest.fail("no halt")

    def test_dump_failure_still_halts(self, tmp_path, monkeypatch):
        """A dump that cannot be written does not replace the halt: MismatchHalt names the problem."""
        m = mon(tmp_path)
        monkeypatch.setattr("rlcheck.core.run.run.write_dump", _raise(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(MismatchHalt, match="dump could not be written.*No space") as info:
            m.observe(0, bad_batch(0))
        assert info.value.dump_dir is None and isinstance(info.value.__cause__, OSError)
        assert steps_of(tmp_path) == [0]

    def test_record_failure_on_halting_step_still_halts(self, tmp_path, monkeypatch):
        """If the halting step's line cannot be written, the halt is raised with the dump and the problem."""
        m = mon(tmp_path)
        monkeypatch.setattr("rlcheck.core.run.journal.Journal._write", _raise(OSError(errno.ENOSPC, "disk full")))
        with pytest.raises(MismatchHalt, match="record was not written.*disk full") as info:
            m.observe(0, bad_batch(0))
        assert read_dump(info.value.dump_dir)[1]["step"] == 0


class TestAtomicDump:
    def test_crash_mid_dump_leaves_no_dump(self, tmp_path, monkeypatch):
        """A failure after the parquet is written leaves neither a step dir nor a temp dir."""
        monkeypatch.setattr("rlcheck.core.run.dump._fsync_file", _raise(OSError(errno.EIO, "I/O error")))
        with pytest.raises(OSError):
            write_dump(tmp_path / "dumps" / "step_000002", synthetic_batch(CFG, 2), step=2)
        assert list((tmp_path / "dumps").iterdir()) == []

    def test_failed_rewrite_keeps_old_dump(self, tmp_path, monkeypatch):
        """Writing a step's dump again and failing leaves the old dump whole."""
        where = write_dump(tmp_path / "step_000002", synthetic_batch(CFG, 2), step=2, reason="first")
        monkeypatch.setattr("rlcheck.core.run.dump._fsync_file", _raise(OSError(errno.EIO, "I/O error")))
        with pytest.raises(OSError):
            write_dump(where, synthetic_batch(CFG, 3), step=2, reason="second")
        assert read_dump(where)[1]["reason"] == "first"
        assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]

    def test_failed_rename_puts_old_dump_back(self, tmp_path, monkeypatch):
        """If the new dump cannot be renamed into place, the old one is moved back whole."""
        where = write_dump(tmp_path / "step_000002", synthetic_batch(CFG, 2), step=2, reason="first")
        real_replace = os.replace

        def replace(src, dst):
            if ".old." not in str(dst) and ".old." not in str(src):
                raise OSError(errno.EIO, "I/O error")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(OSError):
            write_dump(where, synthetic_batch(CFG, 3), step=2, reason="second")
        monkeypatch.undo()
        assert read_dump(where)[1]["reason"] == "first"
        assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]

    def test_rewrite_replaces_whole(self, tmp_path):
        """A second dump of the same step replaces the first whole, leaving no hidden dirs."""
        where = write_dump(tmp_path / "step_000002", synthetic_batch(CFG, 2), step=2, reason="first")
        write_dump(where, synthetic_batch(CFG, 3), step=2, reason="second")
        assert read_dump(where)[1]["reason"] == "second"
        assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]


KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from rlcheck.core.run.dump import write_dump
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

where, cfg = sys.argv[1], SyntheticConfig(num_sequences=24, mean_length=40)
write_dump(where, synthetic_batch(cfg, 2), step=2, reason="first")
real = os.replace
def replace(src, dst):
    real(src, dst)
    if ".old." in str(dst):  # the previous dump moved aside: the process dies before the new one lands
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
write_dump(where, synthetic_batch(cfg, 3), step=2, reason="second")
"""


class TestDumpRewriteKilled:
    """Issue 42 item 10: a process killed between the two renames of a dump rewrite loses neither copy."""

    def test_next_start_keeps_the_finished_dump(self, tmp_path):
        """SIGKILL after the old dump is moved aside and before the new one is renamed into place: the
        next Run (a Monitor's start) puts the finished new dump in place and removes the rest (both
        copies were deleted before)."""
        import subprocess
        import sys

        from rlcheck.core.run import Run

        where = tmp_path / "dumps" / "step_000002"
        done = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(where)], env=dict(os.environ))
        assert done.returncode == -9 and not where.exists()
        assert sorted(p.name.split(".")[2] == "old" for p in (tmp_path / "dumps").iterdir()) == [False, True]
        Run.create(tmp_path).close()
        assert read_dump(where)[1]["reason"] == "second"
        assert [p.name for p in (tmp_path / "dumps").iterdir()] == ["step_000002"]

    def test_cut_short_first_write_is_removed(self, tmp_path):
        """A hidden dir without a dump beside it and nothing moved aside (the first write cut short) is removed."""
        from rlcheck.core.run.dump import remove_partial_dumps

        (tmp_path / "dumps" / ".step_000004.abcd").mkdir(parents=True)
        assert [p.name for p in remove_partial_dumps(tmp_path)] == [".step_000004.abcd"]
        assert list((tmp_path / "dumps").iterdir()) == []


class TestDiskFull:
    def test_full_at_start(self, tmp_path, monkeypatch):
        """A write probe that hits ENOSPC is a RunDirError from the constructor saying the disk is full."""
        monkeypatch.setattr(os, "write", _raise(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(RunDirError, match="is full"):
            mon(tmp_path / "run")

    def test_low_space_warns_at_start(self, tmp_path, monkeypatch):
        """Less free space than LOW_SPACE_BYTES is a warning at start."""
        monkeypatch.setattr(R.shutil, "disk_usage", lambda p: _Usage(10 * 2**20))
        with pytest.warns(UserWarning, match="only 10 MiB free"):
            mon(tmp_path)

    def test_fills_mid_run(self, tmp_path, monkeypatch):
        """A short write at step 2 raises RecordWriteError naming the file and step, carrying the report;
        the other sinks got the step, the file holds whole lines, state stays at step 1, and the run goes on."""
        other = RecordingSink()
        m = mon(tmp_path, other, halt=NO_HALT)
        for s in range(2):
            m.observe(s, synthetic_batch(CFG, s))
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, bytes(b)[: len(b) // 2]))
        with pytest.raises(RecordWriteError, match=r"step 2.*metrics\.jsonl.*short write") as info:
            m.observe(2, synthetic_batch(CFG, 2))
        monkeypatch.undo()
        assert info.value.report.step == 2 and info.value.report.metrics
        assert other.steps == [0, 1, 2] and other.num_flushes == 1
        assert (tmp_path / "metrics.jsonl").read_bytes().endswith(b"\n") and steps_of(tmp_path) == [0, 1]
        assert state_of(tmp_path)["last_step"] == 1
        m.observe(3, synthetic_batch(CFG, 3))
        assert steps_of(tmp_path) == [0, 1, 3]

    def test_state_write_fails_mid_run(self, tmp_path, monkeypatch):
        """A state.json that cannot be replaced is a RecordWriteError naming it; the old state stays
        whole, no temp file is left, and the next Monitor catches up from the logged line."""
        m = mon(tmp_path)
        m.observe(0, synthetic_batch(CFG, 0))
        monkeypatch.setattr(os, "replace", _raise(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(RecordWriteError, match=r"step 1.*state\.json"):
            m.observe(1, synthetic_batch(CFG, 1))
        monkeypatch.undo()
        m.close()
        assert state_of(tmp_path)["last_step"] == 0 and not (tmp_path / ".state.json.tmp").exists()
        with pytest.warns(UserWarning, match=r"held step\(s\) \[1\]"):
            assert mon(tmp_path).last_step == 1


class _Usage:
    def __init__(self, free):
        self.free = free


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail
