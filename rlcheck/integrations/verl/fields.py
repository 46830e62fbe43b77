"""The fields of verl's step batch (a `DataProto`, or a plain mapping of its fields) that rlcheck reads
and writes back: their keys and how they are found (`rlcheck.integrations.verl`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlcheck.core.batch import to_numpy
from rlcheck.core.batch_build import same_storage
from rlcheck.errors import InputError

ROLLOUT_KEY = "rollout_log_probs"
TRAIN_KEY = "old_log_probs"
MASK_KEY = "response_mask"
RESPONSES_KEY = "responses"
WEIGHTS_KEY = "rollout_is_weights"
"""verl's name for the (B, R) importance weights its actor scales the policy loss by."""


def fields_of(data: Any) -> tuple[Any, Mapping[str, Any]]:
    """(tensor fields, non-tensor fields) of a DataProto, or of one plain mapping holding both."""
    if hasattr(data, "batch") and hasattr(data, "non_tensor_batch"):
        if data.batch is None:
            raise InputError("the DataProto has no tensor batch (data.batch is None)")
        return data.batch, data.non_tensor_batch or {}
    if hasattr(data, "keys") and hasattr(data, "__getitem__"):
        return data, data
    raise InputError(
        f"expected a verl DataProto or a mapping of its fields, got {type(data).__name__}"
    )


def get_field(fields: Any, key: str) -> Any:
    return fields[key] if key in fields else None


def logprobs_of(tensors: Any, logp_train: Any) -> tuple[Any, Any]:
    rollout = get_field(tensors, ROLLOUT_KEY)
    if rollout is None:
        raise InputError(
            f"no {ROLLOUT_KEY!r} in the batch: verl stores vLLM's sampling logprobs only with "
            "actor_rollout_ref.rollout.calculate_log_probs=True; set it and rerun"
        )
    train = get_field(tensors, TRAIN_KEY) if logp_train is None else logp_train
    if train is None:
        raise InputError(
            f"no {TRAIN_KEY!r} in the batch: call rlcheck after verl recomputes the actor's logprobs "
            "(after `batch = batch.union(old_log_prob)`), or pass logp_train="
        )
    if same_storage(train, rollout):
        raise InputError(
            f"{TRAIN_KEY} is {ROLLOUT_KEY} itself (algorithm.rollout_correction.bypass_mode=True): verl "
            "does not recompute the logprobs, so there is no mismatch to measure; turn bypass mode off"
        )
    return rollout, train


def response_mask_of(tensors: Any, num_cols: int) -> Any:
    mask = get_field(tensors, MASK_KEY)
    if mask is not None:
        return mask
    attn = get_field(tensors, "attention_mask")  # verl's compute_response_mask: its last R columns
    if attn is None:
        raise InputError(f"no {MASK_KEY!r} (nor attention_mask) in the batch: which tokens count is unknown")
    return to_numpy(attn, "attention_mask")[:, -num_cols:]

