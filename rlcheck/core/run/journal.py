"""`run_dir/metrics.jsonl`: one JSON object per step, the run's journal (its durable record, always
written by the `Run` the Monitor owns; sinks are views of the same records).

Each line is written with a single `os.write` on an `O_APPEND` descriptor and fsynced before `append`
returns, so a crash leaves only whole lines (at worst a truncated last one, which `read_jsonl`
skips). A write that fails or comes up short (disk full) is truncated away before the error is
raised, so a later line never glues onto a part. If the file was left ending mid-line (a kill in
the middle of a large write), opening it again starts a fresh line first, so a resumed run never
glues its records onto a broken one. The durability rules of the whole run directory are in
`rlcheck.core.run.files`.

Non-finite floats (anywhere in the record) are written as the JSON strings "NaN", "Infinity" and
"-Infinity", so every line is strict JSON and NaN stays distinguishable from inf. `read_jsonl` turns
them back into floats where the schema says float: the values of `metrics` and the `max_abs_diff` /
`mean_diff` of each offender; elsewhere (e.g. alarm `details`) they stay strings.

    from rlcheck.core.run.journal import read_jsonl
    records = read_jsonl("runs/exp1/metrics.jsonl"); print(records.num_skipped)
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rlcheck.errors import RunDirError

FILENAME = "metrics.jsonl"
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_OFFENDER_FLOATS = ("max_abs_diff", "mean_diff")


def _encode_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def to_jsonable(x: Any) -> Any:
    """`x` with non-finite floats replaced by their string names and numpy values made plain."""
    if isinstance(x, float):
        return _encode_float(x)
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):  # numpy scalar or array
        return to_jsonable(x.tolist())
    return x


def step_record(report: Any, hist: Any, empty: bool = False, resumed: dict[str, Any] | None = None) -> dict[str, Any]:
    """One step's record of a `StepReport` and its |d| histogram (numpy counts per bin); `empty` and
    `resumed` only where they apply, so older readers see the schema they know."""
    bins = hist.nonzero()[0]
    record = {
        "step": report.step,
        "time": time.time(),
        "metrics": report.metrics,
        "alarms": [a.to_dict() for a in report.alarms],
        "offenders": [o.to_dict() for o in report.offenders],
        "abs_diff_hist": {"bins": bins.tolist(), "counts": hist[bins].tolist()},
    }
    if empty:
        record["empty"] = True
    if resumed is not None:
        record["resumed"] = resumed
    return record


def encode_line(record: dict[str, Any]) -> bytes:
    """One strict-JSON line (newline included); objects JSON cannot hold are written as str()."""
    text = json.dumps(to_jsonable(record), separators=(",", ":"), allow_nan=False, default=str)
    return (text + "\n").encode("utf-8")


class Journal:
    """Appends one fsynced JSON line per step to `run_dir/metrics.jsonl` (or to the run's other JSONL
    file `name`: loop.jsonl), each on a line of its own after a crash cut the last one short."""

    def __init__(self, run_dir: str | os.PathLike[str], name: str = FILENAME):
        self.path = Path(run_dir) / name
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if not _ends_with_newline(self.path):
                self._write(b"\n")  # isolate a line a crash cut short
        except OSError as e:
            raise RunDirError(f"cannot open {self.path} for appending: {e}; check the run directory") from e

    def append(self, step: int, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise RunDirError(f"the journal {self.path} is closed; step {step} was not written")
        line = encode_line(record)
        size = os.fstat(self._fd).st_size
        try:
            self._write(line)
        except OSError as e:
            self._truncate(size)
            raise RunDirError(f"cannot append step {step} to {self.path}: {e}") from e

    def flush(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)  # every append already fsynced; cheap when nothing is pending

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _truncate(self, size: int) -> None:
        """Cut the file back to `size` bytes (a part of a line a failed write left), best effort."""
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError:
            pass  # the reader skips a torn line, and reopening starts a fresh one

    def _write(self, data: bytes) -> None:
        written = os.write(self._fd, data)  # one write: O_APPEND puts the whole line at the end
        if written != len(data):
            raise OSError(f"short write ({written} of {len(data)} bytes; disk full?)")
        os.fsync(self._fd)


def _ends_with_newline(path: Path) -> bool:
    """True if the file is empty or its last byte is a newline."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class Records(list):
    """The records of a metrics.jsonl file; `num_skipped` counts lines that were not valid JSON
    (a truncated last line after a crash, or one left in the middle by a resumed run), `superseded` the
    steps whose earlier records `latest` left out."""

    num_skipped: int = 0
    superseded: tuple[int, ...] = ()

    def latest(self) -> Records:
        """One record per step, the last one journaled (a trainer resumed from an earlier checkpoint
        repeats steps: its records supersede the abandoned ones), in step order; records without an
        integer step are kept, after them."""
        last: dict[int, int] = {}
        for i, r in enumerate(self):
            if isinstance(r.get("step"), int):
                last[r["step"]] = i
        out = Records(self[i] for _, i in sorted(last.items()))
        out.extend(r for r in self if not isinstance(r.get("step"), int))
        out.num_skipped = self.num_skipped
        out.superseded = tuple(sorted({r["step"] for i, r in enumerate(self)
                                       if isinstance(r.get("step"), int) and last[r["step"]] != i}))
        return out


def read_jsonl(path: str | os.PathLike[str], offset: int = 0) -> Records:
    """Every whole record of `path` from byte `offset` on, in file order; non-finite markers decoded
    (see module doc). A line cut short by a crash does not parse and counts as skipped."""
    out = Records()
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                out.num_skipped += 1
                continue
            if isinstance(record, dict):
                out.append(_decode(record))
            else:
                out.num_skipped += 1
    return out


def _decode_float(x: Any) -> Any:
    return _NONFINITE.get(x, x) if isinstance(x, str) else x


def _decode(record: dict[str, Any]) -> dict[str, Any]:
    if isinstance(record.get("metrics"), dict):
        record["metrics"] = {k: _decode_float(v) for k, v in record["metrics"].items()}
    for off in record.get("offenders") or ():
        if isinstance(off, dict):
            for key in _OFFENDER_FLOATS:
                if key in off:
                    off[key] = _decode_float(off[key])
    return record
