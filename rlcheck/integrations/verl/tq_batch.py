"""verl's v1 trainer keeps each step's rows in its TransferQueue, one key per row ("<uid>_<session>_<turn>"),
each field a jagged (nested) tensor of that row's length, the versions in the rows' tags. rlcheck reads
the fields it compares, right-padded, into a `DataProto` (`observe_v1`) and writes its verdict back
as verl's own rollout correction does (`response_mask`, and `rollout_is_weights`), plus `loss_mask`: the
v1 agent loop stores a copy of the response mask there, and verl's FSDP engine counts the tokens of the
loss's denominator from it, so a quarantined row leaves both the loss and its normalisation.

An agent loop's turn count is the row's `num_turns` field (what the legacy trainer's `DataProto` carries as
`non_tensor_batch["__num_turns__"]`; verl's v1 metrics read it from there too): read beside the compared
fields, it gives multi-turn rows their turns (`rlcheck.integrations.verl.turns`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core.types import StepReport
from rlcheck.integrations.verl.fields import MASK_KEY, RESPONSES_KEY, ROLLOUT_KEY, TRAIN_KEY, WEIGHTS_KEY
from rlcheck.integrations.verl.turns import NUM_TURNS_KEY

FIELDS = [TRAIN_KEY, ROLLOUT_KEY, MASK_KEY, RESPONSES_KEY]
LOSS_MASK_KEY = "loss_mask"
VERSION_TAGS = ("min_global_steps", "max_global_steps")
TURNS_FIELD = "num_turns"


def uid_of(key: str) -> str:
    """The prompt's uid of a v1 row key "<uid>_<session>_<turn>"."""
    parts = str(key).rsplit("_", 2)
    return parts[0] if len(parts) == 3 else str(key)


def non_tensors(keys: list[str], tags: list[dict[str, Any]], num_turns: Any = None) -> dict[str, np.ndarray]:
    """The rows' uid, where every tag has them their weight versions (`min/max_global_steps`), and the agent
    loop's turn counts (`num_turns`, one per row) as the legacy trainer's `__num_turns__`."""
    out = {"uid": np.array([uid_of(k) for k in keys], dtype=object)}
    for name in VERSION_TAGS:
        values = [tag.get(name) for tag in tags]
        if values and all(v is not None for v in values):
            out[name] = np.array(values, dtype=object)
    if num_turns is not None:
        out[NUM_TURNS_KEY] = np.asarray(num_turns, dtype=np.int64).reshape(-1)
    return out


def _num_turns(tq: Any, batch: Any) -> list[int] | None:
    """The rows' `num_turns` field as verl's v1 agent loop stored it (None where the rows have none)."""
    try:
        stored = tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id, select_fields=[TURNS_FIELD])
        return [int(n) for n in stored.pop(TURNS_FIELD).tolist()]
    except (KeyError, ValueError, RuntimeError):  # a row source that writes no turn count
        return None


def observe_v1(session: Any, step: int, batch: Any, metrics: dict) -> StepReport:
    """Observe the rows of `batch` (verl's KVBatchMeta) with `session`, after verl wrote old_log_probs;
    the verdict written back into the TransferQueue."""
    import transfer_queue as tq
    from verl import DataProto

    keys = list(batch.keys)
    stored = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=FIELDS)
    padded = stored.to_padded_tensor()  # (B, R) each, right-padded with 0
    data = DataProto(batch=padded, non_tensor_batch=non_tensors(keys, list(batch.tags), _num_turns(tq, batch)))
    before = data.batch[MASK_KEY]
    report = session.observe(step, data, metrics, request_ids=[str(k) for k in keys], global_steps=step)
    if data.batch[MASK_KEY] is not before:
        _write_back(tq, batch, data, stored[MASK_KEY])
    return report


def _write_back(tq: Any, batch: Any, data: Any, jagged_mask: Any) -> None:
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    mask = response_to_nested(data.batch[MASK_KEY], jagged_mask)
    fields = {MASK_KEY: mask, LOSS_MASK_KEY: mask}
    if WEIGHTS_KEY in data.batch.keys():
        fields[WEIGHTS_KEY] = response_to_nested(data.batch[WEIGHTS_KEY], jagged_mask)
    tq.kv_batch_put(keys=list(batch.keys), partition_id=batch.partition_id,
                    fields=TensorDict(fields, batch_size=len(batch.keys)))
