"""`Run`: the one owner of a run directory. The Monitor writes through it (`Run.create`: created,
proved writable, locked, journal open); every reader (summarize, diagnose, report, replay, localize)
opens it once (`Run.open`) and reads each file through it, at most once:

    RUN_DIR/metrics.jsonl   the journal, one record per step (`journal`)
    RUN_DIR/state.json      the Monitor's detector state and journal offset (`files`)
    RUN_DIR/dumps/step_N/   a halted (or asked-for) step's sequences and meta (`dump`)
    RUN_DIR/quarantine/step_N/  a step's quarantined sequences, a dump of the same form
    RUN_DIR/guard/          the engine guard's record (`guard_files`)
    RUN_DIR/loop.jsonl      the GRPO loop's per-step lines (reward, loss, restarts)
    RUN_DIR/context.json    the run's context as the loop recorded it at start (`write_context`)
    RUN_DIR/.lock           the live writer (`files.RunDirLock`)

The context of a run (model, engine, sampling, trainer, fault, the preflight's findings) is the one its
newest dump carries, else context.json's: a run that never dumped still says how it was set up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcheck.core.run import files
from rlcheck.core.run.dump import (
    META,
    SEQUENCES,
    dump_dir,
    quarantine_dir,
    read_dump,
    remove_partial_dumps,
    write_dump,
)
from rlcheck.core.run.guard_files import GuardData, load_guard
from rlcheck.core.run.journal import FILENAME as JOURNAL_FILE
from rlcheck.core.run.journal import Journal, Records, read_jsonl, to_jsonable
from rlcheck.errors import InputError, RunDirError

LOOP_FILE = "loop.jsonl"
CONTEXT_FILE = "context.json"
_UNREAD = object()


@dataclass(frozen=True)
class DumpInfo:
    """One dump of the run, as its meta.json describes it."""

    step: int
    path: Path
    reason: str
    num_sequences: int | None
    files: tuple[Path, ...]
    """meta.json and sequences.parquet, those that exist."""
    context: dict[str, Any]
    """The meta's context: model, engine, sampling, trainer, fault."""


class Run:
    """A run directory. `Run.open(path)` to read one, `Run.create(path)` to write one (the Monitor's)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.journal: Journal | None = None
        self._lock: files.RunDirLock | None = None
        self._read: dict[Any, Any] = {}

    @classmethod
    def open(cls, path: str | os.PathLike[str] | Run) -> Run:
        """A run directory to read (a `Run` is returned as it is); not a directory is an InputError."""
        if isinstance(path, Run):
            return path
        run = cls(path)
        if not run.path.is_dir():
            raise InputError(f"{run.path} does not exist or is not a directory: pass an rlcheck run directory")
        return run

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> Run:
        """The writer's Run: the directory created and proved writable, locked (one live writer),
        half-written dumps of a crash removed, the journal open for appending."""
        run = cls(path)
        files.prepare(run.path)
        run._lock = files.RunDirLock(run.path)  # before anything in the run dir is read or changed
        try:
            remove_partial_dumps(run.path)
            run.journal = Journal(run.path)
        except BaseException:
            run.close()
            raise
        return run

    def close(self) -> None:
        """Close the journal and release the lock (a second call does nothing more)."""
        try:
            if self.journal is not None:
                self.journal.close()
        finally:
            if self._lock is not None:
                self._lock.release()

    # ---- writing (the Monitor) ---------------------------------------------------------------

    def append(self, step: int, record: dict[str, Any]) -> None:
        """One step's record onto the journal, fsynced (an OSError or RunDirError when it failed)."""
        if self.journal is None:
            raise RunDirError(f"{self.path} was opened for reading; use Run.create to write a run")
        self.journal.append(step, record)

    def flush(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def has_state(self) -> bool:
        return (self.path / files.STATE_FILE).exists()

    def save_state(self, state: dict[str, Any]) -> None:
        """state.json, atomically, with the journal's length it has seen (`jsonl_bytes`)."""
        files.atomic_write_json(self.path / files.STATE_FILE, {**state, "jsonl_bytes": files.jsonl_bytes(self.path)})

    def uncommitted(self, committed: int | None) -> Records:
        """The journal's records after byte `committed` (`files.uncommitted_records`)."""
        return files.uncommitted_records(self.path, committed)

    def append_loop(self, line: dict[str, Any]) -> None:
        """One line onto loop.jsonl (the GRPO loop's per-step reward, loss, timings, restarts), written as
        the journal writes its own: whole, fsynced, never glued onto a line a crash cut short. Opened
        for each line: the loop writes its halt's line after the halted Monitor released the run."""
        journal = Journal(self.path, LOOP_FILE)
        try:
            journal.append(int(line.get("step", -1)), line)
        finally:
            journal.close()

    def write_dump(self, step: int, batch: Any, **kwargs: Any) -> Path:
        """The dump of `step` (`rlcheck.core.run.dump.write_dump`) under dumps/."""
        return write_dump(dump_dir(self.path, step), batch, step=step, **kwargs)

    def write_quarantine(self, step: int, batch: Any, **kwargs: Any) -> Path:
        """The quarantined sequences of `step` under quarantine/ (`write_dump`, with `quarantined`)."""
        return write_dump(quarantine_dir(self.path, step), batch, step=step, **kwargs)

    def quarantine_paths(self) -> list[Path]:
        """The run's quarantine dumps, by step."""
        return sorted(d for d in (self.path / "quarantine").glob("step_*") if d.is_dir())

    # ---- reading, each file once ---------------------------------------------------------------

    def _once(self, key: Any, read: Any) -> Any:
        value = self._read.get(key, _UNREAD)
        if value is _UNREAD:
            value = self._read[key] = read()
        return value

    def records(self) -> Records:
        """The journal's records, one per step in step order: where a trainer resumed from an earlier
        checkpoint journaled a step again, the later record (`Records.latest`; `superseded` names the
        steps). An InputError without metrics.jsonl or without a record."""
        return self._once("records", lambda: self._read_records().latest())

    def _read_records(self) -> Records:
        path = self.path / JOURNAL_FILE
        if not path.is_file():
            raise InputError(f"{self.path} has no {JOURNAL_FILE}: is it an rlcheck run directory?")
        records = read_jsonl(path)
        if not records:
            raise InputError(f"{path} holds no complete step record")
        return records

    def state(self) -> dict[str, Any] | None:
        """state.json as saved, or None when there is none or it cannot be read."""
        def read() -> dict[str, Any] | None:
            try:
                state = json.loads((self.path / files.STATE_FILE).read_text())
            except (OSError, ValueError):
                return None
            return state if isinstance(state, dict) else None
        return self._once("state", read)

    def read_state(self) -> dict[str, Any]:
        """state.json for resuming: unreadable is a RunDirError that says the way out."""
        return files.read_state(self.path / files.STATE_FILE)

    def dump_paths(self) -> list[Path]:
        """The dump directories, oldest step first."""
        return self._once("dumps", lambda: sorted(d for d in (self.path / "dumps").glob("step_*") if d.is_dir()))

    def dump_meta(self, path: Path) -> dict[str, Any]:
        """A dump's meta.json ({} when unreadable)."""
        def read() -> dict[str, Any]:
            try:
                meta = json.loads((path / META).read_text())
            except (OSError, ValueError):
                return {}
            return meta if isinstance(meta, dict) else {}
        return self._once(("meta", path), read)

    def dump(self, path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(rows, meta) of one dump (`read_dump`), its meta.json read once with `dump_meta`."""
        return self._once(("dump", path), lambda: read_dump(path, meta=self.dump_meta(path) or None))

    def whole_dumps(self) -> list[Path]:
        """The dumps holding both their files."""
        return [d for d in self.dump_paths() if (d / SEQUENCES).is_file() and (d / META).is_file()]

    def dumps(self) -> list[DumpInfo]:
        """What each dump's meta.json says of it."""
        return [self._info(d) for d in self.dump_paths()]

    def _info(self, d: Path) -> DumpInfo:
        meta = self.dump_meta(d)
        step = meta.get("step", d.name.removeprefix("step_"))
        return DumpInfo(
            step=int(step) if str(step).isdigit() else -1, path=d, reason=str(meta.get("reason", "")),
            num_sequences=meta.get("num_sequences"),
            files=tuple(d / f for f in (META, SEQUENCES) if (d / f).is_file()),
            context=meta.get("context") if isinstance(meta.get("context"), dict) else {},
        )

    def context(self) -> dict[str, Any]:
        """The newest dump's context, else context.json's (`saved_context`); {} without either."""
        return next((d.context for d in reversed(self.dumps()) if d.context), None) or self.saved_context()

    def write_context(self, context: dict[str, Any]) -> None:
        """context.json: the run's context as set up (the loop at start), atomically, beside the dumps'."""
        files.atomic_write_text(self.path / CONTEXT_FILE, json.dumps(to_jsonable(context), default=str, allow_nan=False))

    def saved_context(self) -> dict[str, Any]:
        """context.json as written (`write_context`); {} without one or when unreadable."""
        def read() -> dict[str, Any]:
            try:
                found = json.loads((self.path / CONTEXT_FILE).read_text())
            except (OSError, ValueError):
                return {}
            return found if isinstance(found, dict) else {}
        return self._once("context", read)

    def guard(self) -> GuardData | None:
        """The engine guard's record (run_dir/guard), None when it did not run."""
        return self._once("guard", lambda: load_guard(self.path))

    def loop(self) -> list[dict[str, Any]]:
        """loop.jsonl's lines, one per step as `records` (the later of a repeated step); [] without one."""
        path = self.path / LOOP_FILE
        return self._once("loop", lambda: list(read_jsonl(path).latest()) if path.is_file() else [])
