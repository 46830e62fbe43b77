"""Quarantine in TRL's loss: the loss of a micro-batch is that of the batch the quarantined rows were
never sampled in, for every `loss_type` TRL 1.16 accepts.

Zeroing a row's `completion_mask` is exact only where TRL normalises by tokens (`bnpo`; `dapo`,
`cispo` and `vespo` with `num_items_in_batch` lowered by the row's tokens). Where it averages
per-row losses over the rows (`grpo`, `sapo`, `luspo`) or divides by a constant per row
(`dr_grpo`: B x max_completion_length), a masked row still counts in the denominator and the kept
rows are diluted by (B-k)/B; a NaN in a masked row still poisons the loss (NaN x 0). So the
quarantine marks the rows it keeps (`KEEP_KEY`, a (B,) bool tensor that TRL shuffles and splits with
the rest of the generation batch) and `kept_loss` runs TRL's own `_compute_loss` on the kept rows
alone. Every term TRL computes (policy, KL, entropy bonus, a MoE router's auxiliary loss) is then
that of the batch without the quarantined rows; `num_items_in_batch` is already lowered by their tokens
(`batch.mask_rows`). With several processes, TRL gathers a few per-row tensors for its clip
metrics: those are padded back to B rows with NaN (its `nanmin`/`nanmax` skip them) so every process
gathers the same shape. A micro-batch whose rows are all quarantined runs on its rows with their
non-finite values zeroed and its loss multiplied by 0 (every process still runs its forward and
backward, as FSDP and ZeRO-3 need). Multimodal batches (pixel values are not indexed by row) keep the
masked rows, diluted, with a warning.

The quarantined rows' rewards stay in their group's advantages: TRL computed the advantages before the
Monitor saw the logprobs, and a quarantined sequence was sampled and scored like the others (its
reward is an honest sample of the group's; only its logprobs are not trusted), so the group baseline
keeps it; its own policy-gradient term is what leaves the loss.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlcheck.integrations._patch import replaced

KEEP_KEY = "rlcheck_keep"
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                   "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images", "num_tiles")


def mark_kept(output: dict[str, Any], rows: Sequence[int]) -> None:
    """Mark every row of the generation batch but `rows` (the quarantined ones) as kept."""
    import torch

    mask = output["completion_mask"]
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    keep[list(rows)] = False
    output[KEEP_KEY] = keep


def kept_loss(compute: Callable[[Any, dict], Any], accelerator: Any, model: Any, inputs: dict[str, Any]) -> Any:
    """`compute(model, inputs)` (TRL's `_compute_loss`) on the rows `inputs[KEEP_KEY]` keeps."""
    keep = inputs.get(KEEP_KEY)
    inputs = {k: v for k, v in inputs.items() if k != KEEP_KEY}
    if keep is None or bool(keep.all()):
        return compute(model, inputs)
    if any(inputs.get(k) is not None for k in MULTIMODAL_KEYS):
        warnings.warn("rlcheck: quarantined rows of a multimodal batch are masked, not removed: the loss of "
                      "grpo/sapo/luspo/dr_grpo counts them in its denominator", RuntimeWarning, stacklevel=2)
        return compute(model, _finite(inputs, ~keep))
    if not bool(keep.any()):
        return compute(model, _finite(inputs, ~keep)) * 0.0
    rows, size = keep.nonzero().squeeze(1), keep.shape[0]
    kept = {k: _take(v, rows, size) for k, v in inputs.items()}
    with _padded_gathers(accelerator, len(rows), size):
        return compute(model, kept)


def _take(value: Any, rows: Any, size: int) -> Any:
    """The kept rows of one per-row value (a tensor or list of `size` rows); anything else as it is."""
    import torch

    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == size:
        return value[rows]
    if isinstance(value, list) and len(value) == size:
        return [value[i] for i in rows.tolist()]
    return value


def _finite(inputs: dict[str, Any], rows: Any) -> dict[str, Any]:
    """`inputs` with the non-finite values of `rows` (a (B,) bool) of each float per-row tensor set to 0."""
    import torch

    out = dict(inputs)
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim >= 1 \
                and value.shape[0] == rows.shape[0]:
            bad = ~torch.isfinite(value) & rows.view(-1, *([1] * (value.ndim - 1)))
            if bool(bad.any()):
                out[key] = value.masked_fill(bad, 0.0)
    return out


@contextlib.contextmanager
def _padded_gathers(accelerator: Any, kept: int, size: int) -> Iterator[None]:
    """With several processes, `accelerator.gather` of a per-row tensor (`kept` rows) pads it to
    `size` rows with NaN, so that every process gathers the same shape."""
    if getattr(accelerator, "num_processes", 1) <= 1:
        yield
        return
    gather = accelerator.gather

    def padded(tensor: Any) -> Any:
        import torch

        if isinstance(tensor, torch.Tensor) and tensor.ndim >= 1 and tensor.shape[0] == kept \
                and tensor.is_floating_point():
            pad = tensor.new_full((size - kept, *tensor.shape[1:]), float("nan"))
            tensor = torch.cat([tensor, pad])
        return gather(tensor)

    with replaced(accelerator, "gather", padded):
        yield
