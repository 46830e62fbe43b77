"""A multi-turn batch's turns in its dump (`rlcheck.core.run.dump`): per sequence its tokens' turn
(`turn_index`, int, negative on tool / observation tokens: `Turns.from_index` reads it back), its turn
count, the turn and offset in it of its first divergence, and what the adapter recorded per call (weights
versions, logprob counts, the framework's turn count); meta.json's `turns` says where the turns came from."""

from __future__ import annotations

from typing import Any

import numpy as np


def turn_columns(batch, first: list[int | None], list_column) -> dict[str, Any]:
    """The dump's per-sequence turn columns of `batch` (which carries turns); `first`: each sequence's
    first divergence (None where none), `list_column`: the dump's (values, cu) -> list column."""
    import pyarrow as pa

    turns, cu = batch.turns, batch.cu_seqlens
    index = np.where(turns.tool, -1, turns.index).astype(np.int64)  # (M,) the turn, negative on tool tokens
    offsets = turns.offsets(cu)
    where = [None if f is None else int(cu[i] + f) for i, f in enumerate(first)]
    records = turns.records or (None,) * batch.num_sequences

    def per_call(name: str) -> Any:
        return pa.array([None if r is None or getattr(r, name) is None else list(getattr(r, name)) for r in records],
                        type=pa.list_(pa.int64()))

    return {
        "turn_index": list_column(index, cu),
        "turn_count": pa.array(turns.turn_counts(cu)),
        "first_divergence_turn": pa.array([None if p is None else int(turns.index[p]) for p in where], type=pa.int64()),
        "first_divergence_turn_offset": pa.array([None if p is None else int(offsets[p]) for p in where],
                                                 type=pa.int64()),
        "turn_versions": per_call("versions"),
        "turn_logprob_counts": per_call("logprob_counts"),
        "num_turns_framework": pa.array([None if r is None else r.num_turns for r in records], type=pa.int64()),
    }


def turn_meta(batch) -> dict[str, Any]:
    """meta.json's `turns`: the turns' source and the declared join edits."""
    join = batch.turns.join
    return {"source": batch.turns.source,
            "join": None if join is None else {"remove_trailing": list(join.remove_trailing),
                                               "insert_after": [[a, list(ids)] for a, ids in join.insert_after]}}
