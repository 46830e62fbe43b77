"""Handing rlcheck's verdict back to verl: the quarantine's keep mask and the correction's weights
written into the step's `DataProto` as verl's own rollout correction writes them
(`rlcheck.integrations.verl`, "Handing the verdict back")."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core.batch import to_numpy
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.types import StepReport
from rlcheck.errors import InputError
from rlcheck.integrations.verl.fields import (
    MASK_KEY,
    WEIGHTS_KEY,
    fields_of,
    get_field,
    logprobs_of,
    response_mask_of,
)


def update_batch(data: Any, report: StepReport, correction: CorrectionConfig | None = None, *,
                 logp_train: Any = None) -> None:
    """Write `report`'s verdict on `data` (the batch it observed, one sequence per row) into `data`, in
    place, as verl's `compute_rollout_correction_and_add_to_batch` writes its own: a new `response_mask`,
    0 on the rows `report.keep` drops and, with `correction`, on the tokens outside its mask (rejected,
    or non-finite); with `correction.rollout_is`, `rollout_is_weights` (B, R) in the dtype and device
    of `old_log_probs` (or `logp_train`), 0 off the new mask. Nothing is written when every row is
    kept and `correction` is off."""
    enabled = correction is not None and correction.enabled
    if report.keep is None or (report.keep.all() and not enabled):
        return
    if report.batch is None:
        raise InputError("the report holds no batch (released): update_batch needs the one it observed")
    tensors, _ = fields_of(data)
    rollout, train = logprobs_of(tensors, logp_train)
    valid = to_numpy(response_mask_of(tensors, rollout.shape[-1]), MASK_KEY).astype(bool)  # (B, R)
    if not enabled:
        kept = np.repeat(report.keep, np.diff(report.batch.cu_seqlens))  # (M,)
        tensors[MASK_KEY] = _like(_padded(kept, report, valid), _mask_like(tensors))
        return
    c = report.correction(correction.rollout_is, correction.rollout_is_threshold, correction.rollout_rs,
                          correction.rollout_rs_threshold, correction.rollout_is_batch_normalize)
    tensors[MASK_KEY] = _like(_padded(c.mask, report, valid), _mask_like(tensors))
    if correction.rollout_is is not None:
        tensors[WEIGHTS_KEY] = _like(_padded(c.weights, report, valid), train)


def _padded(values: np.ndarray, report: StepReport, valid: np.ndarray) -> np.ndarray:
    """(B, R) of per-token `values` (M,) packed like `report.batch`, 0 off `valid`: the packed tokens
    of the batch's mask are verl's response tokens in row-major order (`StepBatch.from_padded`)."""
    batch = report.batch
    picked = values if batch.mask is None else values[batch.mask]
    if batch.num_sequences != valid.shape[0] or picked.shape[0] != int(valid.sum()):
        raise InputError(
            f"the report observed {batch.num_sequences} rows and {picked.shape[0]} response tokens, the batch "
            f"holds {valid.shape[0]} and {int(valid.sum())}: pass update_batch the batch the report observed"
        )
    out = np.zeros(valid.shape, dtype=values.dtype)
    out[valid] = picked
    return out


def _mask_like(tensors: Any) -> Any:
    """The tensor whose dtype and device the new response_mask takes: the old one (verl always sets it),
    else attention_mask (what it was read from)."""
    found = get_field(tensors, MASK_KEY)
    return found if found is not None else get_field(tensors, "attention_mask")


def _like(values: np.ndarray, ref: Any) -> Any:
    """`values` as `ref` holds numbers: a tensor of its dtype on its device, or a numpy array of its dtype."""
    if hasattr(ref, "new_tensor"):
        return ref.new_tensor(values)
    return np.asarray(values, dtype=ref.dtype)
