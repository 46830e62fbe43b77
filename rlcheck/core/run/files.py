"""The run directory's durability rules: what is fsynced, in which order, and how a run resumes
after a crash. The Monitor uses these; nothing here knows about statistics.

What is fsynced (every write the Monitor makes):

    metrics.jsonl   each step is one `os.write` of a whole line on an O_APPEND descriptor, fsynced
                    before the sink returns (`rlcheck.core.run.journal`); a failed or short write is
                    truncated away, so the file holds only whole lines
    state.json      every step: written to `.state.json.tmp`, fsynced, renamed over, directory fsynced
    dumps/step_N/   files written and fsynced in a hidden temp dir, renamed into place, parent
                    fsynced, all before `MismatchHalt` is raised (`rlcheck.core.run.dump`)
    start           a probe file is created, written, fsynced and deleted, so an unwritable or full
                    run directory is a `RunDirError` from the constructor, not from step 500
    W&B, console    not ours to fsync (wandb writes its own files; the console is flushed)
    .lock           not written durably: it holds the pid of the live Monitor (`RunDirLock`)

One live Monitor per run directory: `RunDirLock` takes an exclusive `flock` on `.lock` through a
descriptor the Monitor keeps open, so the kernel releases it on `close()` and on process death of any
kind (SIGKILL included); a second Monitor, in this process or another, gets a `RunDirError` naming the
holder. The file itself stays (deleting it would let two processes lock two different files).

Commit order per step: the metrics.jsonl line first, then state.json, which records how long
metrics.jsonl was when it was saved (`jsonl_bytes`). A step is recorded once its line is on disk.
A process killed between the two writes leaves a line after that offset; `uncommitted_records`
returns it and the Monitor replays its metrics through the detectors on resume, so the resumed run
neither loses that step from the detectors' history nor logs it twice.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import warnings
import weakref
from pathlib import Path
from typing import Any

from rlcheck.core.run.journal import FILENAME as JSONL_FILE
from rlcheck.core.run.journal import Records, read_jsonl
from rlcheck.errors import RunDirError

STATE_FILE = "state.json"
LOCK_FILE = ".lock"
PROBE_FILE = ".rlcheck-write-probe"
PROBE_BYTES = 4096  # one filesystem block: a full disk refuses it
LOW_SPACE_BYTES = 256 * 2**20
"""Below this much free space at start, the Monitor warns (dumps of large steps take megabytes)."""
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def write_all(fd: int, data: bytes) -> None:
    """`os.write` until every byte is written; a write that makes no progress is ENOSPC."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename inside it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """Replace `path` with `text`: temp file, rename (with `durable`, an fsync of the file before and
    of the directory after). Readers see the old file or the new one, never a part; a failure leaves
    the old one and no temp file, and its OSError goes on."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, text.encode())
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """`atomic_write_text` of `obj` as JSON, durable; a failure is a RunDirError."""
    try:
        atomic_write_text(path, json.dumps(obj, allow_nan=False))
    except OSError as exc:
        raise RunDirError(f"cannot save {path}: {exc}") from exc


def prepare(run_dir: Path) -> None:
    """Create `run_dir` and prove it takes a write (create, write a block, fsync, delete);
    warn when free space is low."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _probe(run_dir / PROBE_FILE)
    except OSError as exc:
        if exc.errno in _FULL:
            raise RunDirError(f"run directory {run_dir} is full ({exc.strerror}): free space there or "
                              "choose another run_dir") from None
        raise RunDirError(f"run directory {run_dir} is not writable: {exc}") from None
    free = shutil.disk_usage(run_dir).free
    if free < LOW_SPACE_BYTES:
        warnings.warn(f"rlcheck: only {free / 2**20:.0f} MiB free under {run_dir}; metrics.jsonl grows by "
                      "a few kB a step and a halt writes the step's dump", stacklevel=3)


def _probe(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def read_state(path: Path) -> dict[str, Any]:
    """state.json as a dict; an unreadable one is a RunDirError that says the way out."""
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path} cannot be read ({exc}); move it away to start the detectors afresh "
                          "(metrics.jsonl is kept and appended to), or choose a new run_dir") from None
    return state


def jsonl_bytes(run_dir: Path) -> int | None:
    """The current length of run_dir/metrics.jsonl (None when there is none)."""
    try:
        return (run_dir / JSONL_FILE).stat().st_size
    except FileNotFoundError:
        return None


def uncommitted_records(run_dir: Path, committed: int | None) -> Records:
    """The whole records of metrics.jsonl after byte `committed` (state.json's `jsonl_bytes`): steps
    logged by a process that stopped before saving their state; `num_skipped` counts torn lines.
    A file shorter than `committed` (truncated or replaced since) gives no records, with a warning."""
    size = jsonl_bytes(run_dir)
    if committed is None or size is None or size == committed:
        return Records()
    if size < committed:
        warnings.warn(f"rlcheck: {run_dir / JSONL_FILE} is shorter ({size} bytes) than when state.json "
                      f"was saved ({committed}); was it truncated or replaced? Resuming from state.json",
                      stacklevel=3)
        return Records()
    return read_jsonl(run_dir / JSONL_FILE, offset=committed)


class RunDirLock:
    """The exclusive lock of one live Monitor on `run_dir` (an existing directory), held from
    construction to `release()`; a lock nobody references any more is released with its descriptor,
    and the kernel releases it when the process dies. Raises `RunDirError` when another holder (this
    process or another) has it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunDirError(f"cannot open the lock file {self.path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"cannot lock {self.path}: {exc}") from None
            raise RunDirError(
                f"{run_dir} is in use by another live Monitor ({holder}): one Monitor writes a run "
                "directory at a time. Close that one first (Monitor.close(), or leave its `with` block), "
                "or let its process end; then a new Monitor resumes the run. Or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._release = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Give the lock up (closing its descriptor); a second call does nothing."""
        self._release()


def _read_holder(fd: int) -> str:
    """'pid P on host H' from the lock file of the current holder, as far as it can be read."""
    try:
        pid, host = os.pread(fd, 256, 0).decode().split()
    except (OSError, ValueError):
        return "pid unknown"
    return f"pid {pid} on host {host}"
