"""Tests of rlcheck.core.run.files: atomic JSON, the start-up write probe, the lines a crash left uncommitted,
and the lock that keeps one live Monitor per run directory."""

from __future__ import annotations

import errno
import json
import os

import pytest

from rlcheck.core.run import files as R
from rlcheck.core.run.journal import Journal
from rlcheck.errors import RunDirError
from rlcheck.sinks.testing import example_record


class TestWriteAll:
    def test_loops_over_short_writes(self, tmp_path, monkeypatch):
        """Short writes are continued until every byte is written."""
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, bytes(b)[:3]))
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        R.write_all(fd, b"0123456789")
        os.close(fd)
        assert (tmp_path / "f").read_bytes() == b"0123456789"

    def test_no_progress_is_enospc(self, tmp_path, monkeypatch):
        """A write that writes nothing is reported as ENOSPC, never an endless loop."""
        monkeypatch.setattr(os, "write", lambda fd, b: 0)
        with pytest.raises(OSError) as info:
            R.write_all(0, b"x")
        assert info.value.errno == errno.ENOSPC


class TestAtomicWriteJson:
    def test_replaces_and_fsyncs(self, tmp_path, monkeypatch):
        """The new content replaces the old; the file and then its directory are fsynced."""
        path = tmp_path / "state.json"
        R.atomic_write_json(path, {"a": 1})
        synced = []
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.isdir(f"/proc/self/fd/{fd}")) or real_fsync(fd))
        R.atomic_write_json(path, {"a": 2})
        assert json.loads(path.read_text()) == {"a": 2}
        assert synced == [False, True]
        assert sorted(os.listdir(tmp_path)) == ["state.json"]

    def test_failure_keeps_old_file(self, tmp_path, monkeypatch):
        """A failed write is a RunDirError naming the file; the old file stays whole, no temp file is left."""
        path = tmp_path / "state.json"
        R.atomic_write_json(path, {"a": 1})
        monkeypatch.setattr(os, "write", _full)
        with pytest.raises(RunDirError, match="state.json.*No space"):
            R.atomic_write_json(path, {"a": 2})
        monkeypatch.undo()
        assert json.loads(path.read_text()) == {"a": 1} and sorted(os.listdir(tmp_path)) == ["state.json"]


class TestPrepare:
    def test_probe_is_fsynced_and_removed(self, tmp_path, monkeypatch):
        """The start-up probe writes a block, fsyncs it and leaves nothing behind."""
        calls = []
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real_fsync(fd))
        R.prepare(tmp_path / "run")
        assert len(calls) == 1 and os.listdir(tmp_path / "run") == []

    def test_not_writable(self, tmp_path):
        """A run dir under a file is 'not writable', from prepare."""
        (tmp_path / "f").write_text("")
        with pytest.raises(RunDirError, match="not writable"):
            R.prepare(tmp_path / "f" / "run")

    @pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
    def test_full(self, tmp_path, monkeypatch, code):
        """No space or no quota at start is a RunDirError that says the directory is full."""
        monkeypatch.setattr(os, "write", lambda fd, b: _full(fd, b, code))
        with pytest.raises(RunDirError, match="is full"):
            R.prepare(tmp_path / "run")


class TestUncommittedRecords:
    def _log(self, run_dir, steps):
        journal = Journal(run_dir)
        for s in steps:
            journal.append(s, example_record(s))
        journal.close()
        return R.jsonl_bytes(run_dir)

    def test_none_when_in_step(self, tmp_path):
        """A file exactly as long as state.json recorded has nothing uncommitted."""
        assert R.uncommitted_records(tmp_path, self._log(tmp_path, [0, 1])) == []
        assert R.uncommitted_records(tmp_path, None) == []

    def test_lines_after_offset(self, tmp_path):
        """Lines after the recorded length come back, in order."""
        committed = self._log(tmp_path, [0])
        self._log(tmp_path, [1, 2])
        assert [r["step"] for r in R.uncommitted_records(tmp_path, committed)] == [1, 2]

    def test_shorter_file_warns(self, tmp_path):
        """A file shorter than recorded (truncated, replaced) warns and gives nothing to replay."""
        size = self._log(tmp_path, [0])
        with pytest.warns(UserWarning, match="shorter"):
            assert R.uncommitted_records(tmp_path, size + 100) == []


class TestRunDirLock:
    def test_second_holder_refused_naming_the_first(self, tmp_path):
        """A second lock on a locked run dir is a RunDirError naming the holder's pid and the way out;
        the file records the holder."""
        first = R.RunDirLock(tmp_path)
        assert (tmp_path / R.LOCK_FILE).read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunDirError, match=rf"in use by .*pid {os.getpid()}.*close\(\)"):
            R.RunDirLock(tmp_path)
        first.release()

    def test_release_frees_and_is_idempotent(self, tmp_path):
        """After release (twice is fine) the run dir can be locked again; other dirs never conflict."""
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
        first = R.RunDirLock(tmp_path / "a")
        other = R.RunDirLock(tmp_path / "b")
        first.release()
        first.release()
        R.RunDirLock(tmp_path / "a").release()
        other.release()

    def test_dropped_lock_is_released(self, tmp_path):
        """A lock nobody holds a reference to any more is released with its descriptor."""
        R.RunDirLock(tmp_path)
        R.RunDirLock(tmp_path).release()


def _full(fd, data, code=errno.ENOSPC):
    raise OSError(code, os.strerror(code))


class TestRun:
    def test_writer_appends_saves_and_locks(self, tmp_path):
        """Run.create: records appended to the journal (and loop.jsonl), the state saved with its offset; a second
        writer on the same directory is refused until the first closes."""
        from rlcheck.core.run import Run

        run = Run.create(tmp_path / "r")
        try:
            run.append(0, example_record(0))
            run.append_loop({"step": 0, "reward_mean": 0.5})
            run.save_state({"version": 1})
            assert Run.open(tmp_path / "r").loop() == [{"step": 0, "reward_mean": 0.5}]
            assert R.read_state(tmp_path / "r" / R.STATE_FILE)["jsonl_bytes"] == R.jsonl_bytes(tmp_path / "r") > 0
            with pytest.raises(RunDirError, match="another live Monitor"):
                Run.create(tmp_path / "r")
        finally:
            run.close()
        Run.create(tmp_path / "r").close()

    def test_reader_reads_once_and_refuses_writes(self, tmp_path):
        """Run.open: the records as appended (read once: a line added later is not seen by the same
        Run), appending is a RunDirError, and a missing directory or journal an InputError."""
        from rlcheck.core.run import Run
        from rlcheck.errors import InputError

        writer = Run.create(tmp_path / "r")
        writer.append(0, example_record(0))
        reader = Run.open(tmp_path / "r")
        assert [r["step"] for r in reader.records()] == [0]
        writer.append(1, example_record(1))
        writer.close()
        assert [r["step"] for r in reader.records()] == [0]
        assert [r["step"] for r in Run.open(tmp_path / "r").records()] == [0, 1]
        with pytest.raises(RunDirError, match="opened for reading"):
            reader.append(2, example_record(2))
        with pytest.raises(InputError, match="does not exist"):
            Run.open(tmp_path / "missing")
        (tmp_path / "empty").mkdir()
        with pytest.raises(InputError, match="no metrics.jsonl"):
            Run.open(tmp_path / "empty").records()
        assert Run.open(tmp_path / "empty").loop() == [] and Run.open(tmp_path / "empty").guard() is None
