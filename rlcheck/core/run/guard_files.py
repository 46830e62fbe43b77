"""What the engine guard leaves on disk, and how diagnose and the report read it back (JSON only).

    DIR/guard/summary.json      counts per check, the requests that broke each, the pool, the policies
    DIR/guard/violations.jsonl  one violation per line (the first per request and check), as they happen
    DIR/guard/trace.jsonl       the ring buffer: one line per forward step (columns per request)
    DIR/guard/break/<id>/step_NNNNNN.json   RLCHECK_BREAK_ON snapshots (scheduler output, metadata)

DIR is the run directory (`GuardConfig.run_dir`), or a dump (`GuardOutput.write`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcheck.core.run.files import atomic_write_text
from rlcheck.core.run.guard_record import CHECKS, StepRecord, Violation

GUARD_DIR = "guard"
SUMMARY = "summary.json"
VIOLATIONS = "violations.jsonl"
TRACE = "trace.jsonl"
BREAK_DIR = "break"


def record_to_dict(rec: StepRecord) -> dict[str, Any]:
    """One trace line: the step's columns, one entry per request (and per Mamba group)."""
    out: dict[str, Any] = {
        "step": rec.step, "call_step": rec.call_step, "request_ids": list(rec.request_ids),
        "phase": [rec.phase(i) for i in range(rec.num_reqs)], "computed": rec.computed.tolist(),
        "scheduled": rec.scheduled.tolist(), "prompt_len": rec.prompt_len.tolist(), "new": rec.new.tolist(),
        "finished": list(rec.finished), "mamba_groups": list(rec.groups),
    }
    if rec.groups:
        out.update(slot=rec.slot.tolist(), assigned=rec.assigned.tolist(), decode=rec.decode.tolist(),
                   initial_state=rec.initial_state.tolist())
    if rec.attn_groups:
        out["attention_groups"] = list(rec.attn_groups)
        out["blocks"] = [[r.row(i).tolist() for i in range(rec.num_reqs)] for r in rec.blocks]
    return out


def row_of(rec: StepRecord, i: int) -> dict[str, Any]:
    """One request of a step record, as a snapshot shows it."""
    return {"request_id": rec.request_ids[i], "phase": rec.phase(i), "computed": int(rec.computed[i]),
            "scheduled": int(rec.scheduled[i]), "prompt_len": int(rec.prompt_len[i]), "new": bool(rec.new[i]),
            "mamba": [{"group": gid, "slot": int(rec.slot[i, g]), "assigned": int(rec.assigned[i, g]),
                       "kernel": rec.kernel_phase(i, g)} for g, gid in enumerate(rec.groups)],
            "attention_blocks": {str(gid): r.row(i).tolist() for gid, r in zip(rec.attn_groups, rec.blocks, strict=True)}}


def _dumps(x: Any, indent: int | None = None) -> str:
    from rlcheck.core.run.journal import to_jsonable

    return json.dumps(to_jsonable(x), allow_nan=False, default=str, indent=indent)


def _atomic_write(path: Path, text: str) -> None:
    """Replace `path` whole; not fsynced (the guard flushes inside the engine's step)."""
    atomic_write_text(path, text, durable=False)


def write_summary(directory: Path, summary: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / SUMMARY, _dumps(summary, indent=1))


def write_trace(directory: Path, trace: list[StepRecord]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / TRACE, "".join(_dumps(record_to_dict(r)) + "\n" for r in trace))


def violation_line(v: Violation) -> str:
    return _dumps(v.to_dict()) + "\n"


@dataclass(frozen=True)
class GuardOutput:
    """Everything a guard knows at one moment: writable into any directory (a dump, a stress run)."""

    summary: dict[str, Any]
    violations: tuple[Violation, ...]
    trace: tuple[StepRecord, ...] = ()

    def write(self, directory: str | os.PathLike) -> Path:
        """DIR/guard/{summary.json, violations.jsonl, trace.jsonl}; returns DIR/guard."""
        out = Path(directory) / GUARD_DIR
        write_summary(out, self.summary)
        _atomic_write(out / VIOLATIONS, "".join(violation_line(v) for v in self.violations))
        write_trace(out, list(self.trace))
        return out


@dataclass(frozen=True)
class GuardData:
    """Guard output read back from a directory (for diagnose and the report)."""

    path: Path
    summary: dict[str, Any]
    violations: list[Violation]
    snapshots: list[Path] = field(default_factory=list)

    def by_check(self) -> dict[str, list[Violation]]:
        out: dict[str, list[Violation]] = {c: [] for c in CHECKS}
        for v in self.violations:
            out.setdefault(v.check, []).append(v)
        return {c: vs for c, vs in out.items() if vs}


def load_guard(directory: str | os.PathLike) -> GuardData | None:
    """DIR/guard as written by the guard; None when there is none. Unreadable lines are skipped."""
    path = Path(directory) / GUARD_DIR
    if not path.is_dir():
        return None
    try:
        summary = json.loads((path / SUMMARY).read_text())
    except (OSError, ValueError):
        summary = {}
    violations = []
    try:
        lines = (path / VIOLATIONS).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            violations.append(Violation.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue
    snapshots = sorted((path / BREAK_DIR).glob("*/step_*.json"))
    if not summary and not violations and not snapshots:
        return None
    return GuardData(path, summary, violations, snapshots)


def safe_name(request_id: str) -> str:
    """A request id as a folder name (anything outside [A-Za-z0-9._-] becomes '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", request_id)[:120] or "_"
