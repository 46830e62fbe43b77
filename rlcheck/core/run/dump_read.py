"""Reading a dump back (`rlcheck.core.run.dump` writes it): one dict per sequence, its per-token columns
as numpy slices of one flat array per column (no Python object per token), and meta.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
from rlcheck.errors import InputError

SEQUENCES = "sequences.parquet"
META = "meta.json"
TOKEN_COLUMNS = ("prompt_tokens", "response_tokens", "tokens_train")
ARRAY_COLUMNS = ("logp_rollout", "logp_train", "mask", *TOKEN_COLUMNS, PROMPT_TOKENS_TRAIN, "experts_rollout",
                 "experts_train")
"""The per-token list columns `read_dump` hands back as numpy arrays."""


def read_dump(directory: str | os.PathLike, meta: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, meta) of a dump: one dict per sequence, its list columns as numpy arrays (views of one
    array per column: no Python object per token; the experts (T, L, k)), and meta.json (`meta`:
    already read by the caller)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    if not (directory / SEQUENCES).is_file() or not (directory / META).is_file():
        raise InputError(f"{directory} is not an rlcheck dump (needs {SEQUENCES} and {META})")
    with open(directory / SEQUENCES, "rb") as f:  # one Python open (what the run's readers count)
        data = f.read()
    # pyarrow's reader threads could abort the process at exit ("terminate called without an active
    # exception", 3 of 8 `rlcheck diagnose` runs here); a dump is small, one thread reads it
    table = pq.read_table(pa.BufferReader(data), use_threads=False)
    meta = json.loads((directory / META).read_text()) if meta is None else meta
    shape = (meta["routing"]["moe_layers"], meta["routing"]["top_k"]) if meta.get("routing") else None
    columns = {name: _read_column(table.column(name), name in ARRAY_COLUMNS) for name in table.column_names}
    for key in ("logp_rollout", "logp_train"):
        columns[key] = [None if v is None else v.astype(np.float64, copy=False) for v in columns[key]]
    for key in ("experts_rollout", "experts_train") if shape else ():
        columns[key] = [None if v is None else v.reshape(-1, *shape) for v in columns[key]]  # (T, L, k)
    return [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)], meta


def _read_column(column: Any, as_arrays: bool) -> list[Any]:
    """One parquet column, per row: with `as_arrays` (a per-token list column) numpy slices of its flat
    values (None where null), else Python values (the meta columns, as they were given)."""
    import pyarrow as pa

    column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not as_arrays or not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return column.to_pylist()
    offsets = column.offsets.to_numpy()  # (N+1,) into `values`
    values = column.values.to_numpy(zero_copy_only=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(column))]
