"""Handing rlcheck's verdict back to verl: the quarantine's keep mask and the correction's weights
written into the step's `DataProto` as verl's own rollout correction writes them
(`rlcheck.integrations.verl`, "Handing the verdict back")."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlcheck.core.batch import to_numpy
from rlcheck.core.batch_build import padded_spans
from rlcheck.core.correction import CorrectionConfig, correct
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
    kept and `correction` is off.

    The verdict covers every token verl trains on (`response_mask`), also those the report left out
    of its statistics (the fully async trainer's lagged rows): the correction is computed over them
    as verl's own would be, and a row the quarantine did not judge is kept."""
    enabled = correction is not None and correction.enabled
    if report.keep is None or (report.keep.all() and not enabled):
        return
    if report.batch is None:
        raise InputError("the report holds no batch (released): update_batch needs the one it observed")
    tensors, _ = fields_of(data)
    rollout, train = logprobs_of(tensors, logp_train)
    valid = to_numpy(response_mask_of(tensors, rollout.shape[-1]), MASK_KEY).astype(bool)  # (B, R)
    spans = _spans(report, valid)  # (B, R): where the report's packed tokens lie
    trained = valid[spans]  # (M,) the tokens verl trains on, packed as the report's batch
    if not enabled:
        kept = np.repeat(report.keep, np.diff(report.batch.cu_seqlens)) & trained  # (M,)
        tensors[MASK_KEY] = _like(_scatter(kept, spans), _mask_like(tensors))
        return
    c = correct(dataclasses.replace(report.batch, mask=trained), report.keep, correction)
    tensors[MASK_KEY] = _like(_scatter(c.mask, spans), _mask_like(tensors))
    if correction.rollout_is is not None:
        tensors[WEIGHTS_KEY] = _like(_scatter(c.weights, spans), train)


def _spans(report: StepReport, valid: np.ndarray) -> np.ndarray:
    """(B, R) bool: the positions of `valid`'s rows the report's batch packed (`StepBatch.from_padded`
    keeps each row from its first to its last valid token), checked against the batch's rows."""
    batch, spans = report.batch, padded_spans(valid)
    lens = spans.sum(axis=1)  # (B,)
    if batch.num_sequences != valid.shape[0] or not np.array_equal(lens, np.diff(batch.cu_seqlens)):
        raise InputError(
            f"the report observed {batch.num_sequences} rows and {batch.num_tokens} response tokens, the batch "
            f"holds {valid.shape[0]} and {int(lens.sum())}: pass update_batch the batch the report observed"
        )
    return spans


def _scatter(values: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """(B, R) of per-token `values` (M,) packed at `spans`, 0 elsewhere."""
    out = np.zeros(spans.shape, dtype=values.dtype)
    out[spans] = values
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
