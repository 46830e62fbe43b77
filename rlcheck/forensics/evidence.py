"""What diagnose reads: a run's step records (metrics.jsonl), or a dump turned into one such record.

A record is `{"step", "metrics", "alarms", "offenders"}` as the Monitor logs it. A dump holds every
sequence of its step, so its record is recomputed from the sequences (statistics and signatures) and
keeps the per-sequence rows for the affected request ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.dump import META, SEQUENCES, read_dump
from rlcheck.errors import InputError
from rlcheck.sinks.jsonl import FILENAME


@dataclass
class Evidence:
    source: str
    """"run" or "dump"."""
    path: Path
    records: list[dict[str, Any]]
    """Step records in step order."""
    dump_rows: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """step -> the sequences of that step's dump (request_id, max_abs_diff, first_divergence, ...)."""


def load_evidence(path: str | Path, records: list[dict[str, Any]] | None = None) -> Evidence:
    """A run directory (holds metrics.jsonl; its dumps are read too) or one dump directory.
    `records`: the run's `rlcheck.summarize.read_records(path)` when already read."""
    from rlcheck.summarize import read_records

    path = Path(path)
    if records is not None or (path / FILENAME).is_file():
        records = read_records(path) if records is None else records
        ev = Evidence("run", path, sorted(records, key=lambda r: r["step"]))
        for d in sorted((path / "dumps").glob("step_*")):
            if (d / SEQUENCES).is_file() and (d / META).is_file():
                rows, meta = read_dump(d)
                ev.dump_rows[int(meta["step"])] = rows
        return ev
    if (path / SEQUENCES).is_file():
        rows, meta = read_dump(path)
        return Evidence("dump", path, [dump_record(rows, meta)], {int(meta["step"]): rows})
    raise InputError(
        f"{path} is neither a run directory (with {FILENAME}) nor a dump (with {SEQUENCES} and {META})"
    )


def dump_record(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The step record of a dump: statistics and signature alarms recomputed from its sequences."""
    from rlcheck.batch import StepBatch
    from rlcheck.detect.signature import SignatureDetector
    from rlcheck.stats import StatsConfig, compute

    def column(name: str):
        values = [row.get(name) for row in rows]
        return None if any(v is None for v in values) else [np.asarray(v) for v in values]

    batch = StepBatch.from_ragged(
        logp_rollout=[row["logp_rollout"] for row in rows],
        logp_train=[row["logp_train"] for row in rows],
        request_ids=[row["request_id"] for row in rows],
        mask=column("mask"),
        tokens=column("response_tokens"),
        tokens_train=column("tokens_train"),
    )
    metrics, offenders = compute(batch, StatsConfig())
    step = int(meta.get("step", 0))
    alarms = [a.to_dict() for a in SignatureDetector().update(step, metrics)]
    # the run's other alarms of this step (periodic, drift, ...) need its history: take them as logged
    alarms += [a for a in meta.get("alarms", []) if a.get("kind") != "signature"]
    return {"step": step, "metrics": metrics, "alarms": alarms, "offenders": [o.to_dict() for o in offenders]}
