"""TRL's GRPO step tensors as a `StepBatch`: pure conversion, no trl, torch only through `to_numpy`.

`GRPOTrainer._generate_and_score_completions` returns, per process, one padded batch of B rows
(B = per_device_train_batch_size x steps_per_generation, in generation order, before TRL shuffles it):

    prompt_ids, prompt_mask          (B, P) int    left-padded prompt
    completion_ids, completion_mask  (B, C) int    right-padded completion; mask 0 on padding and,
                                                   with mask_truncated_completions, on truncated rows
    sampling_per_token_logps         (B, C) float  vLLM's logprob of each sampled token (0.0 on padding,
                                                   NaN where vLLM returned none)
    old_per_token_logps              (B, C) float  the trainer's recomputation under the same weights,
                                                   raw: TRL clips/masks only the ratio it derives from it
    tool_mask                        (B, C) int    optional, 0 on tool output

Request ids: TRL does not expose vLLM's, so row i of process `rank` at step s is "s{s}-r{rank}-{i}",
unique across steps, processes and samples of one run (a resumed run that repeats a step repeats its
ids). Per-row meta: rank, row, prompt_index and sample_index in the global generation batch (process
order, `num_generations` consecutive rows per prompt, as TRL groups them for the advantages), and
`weight_version`, the step whose weights vLLM last received.

Quarantine: `mask_rows` zeroes the `completion_mask` rows of quarantined sequences (found by request
id, `quarantined_rows`), so TRL's loss gives them no weight; every other tensor stays as TRL made it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch, to_numpy
from rlcheck.errors import InputError

ROLLOUT_KEY = "sampling_per_token_logps"
TRAIN_KEY = "old_per_token_logps"
MASK_KEY = "completion_mask"
TOOL_MASK_KEY = "tool_mask"
FORWARD_PREFIXES = ("sampling/", "reward")
"""TRL step metrics logged beside rlcheck's (as `trl/<name>`): its own |d| and clipped ratio view, rewards."""


def request_ids(step: int, rank: int, num_rows: int) -> list[str]:
    """"s{step}-r{rank}-{i}" for the rows of one process at one step."""
    return [f"s{step}-r{rank}-{i}" for i in range(num_rows)]


def row_meta(rank: int, num_rows: int, num_generations: int, weight_version: int | None) -> dict[str, list]:
    """Per-row columns for the dump; rows of rank r start at r x num_rows in the global batch."""
    rows = np.arange(num_rows, dtype=np.int64)
    global_rows = rank * num_rows + rows
    meta: dict[str, list] = {
        "rank": [rank] * num_rows,
        "row": rows.tolist(),
        "prompt_index": (global_rows // num_generations).tolist(),
        "sample_index": (global_rows % num_generations).tolist(),
    }
    if weight_version is not None:
        meta["weight_version"] = [weight_version] * num_rows
    return meta


def response_mask(output: Mapping[str, Any]) -> np.ndarray:
    """(B, C) bool: completion_mask, and tool_mask when TRL has one (tool output does not count)."""
    if MASK_KEY not in output:
        raise InputError(f"no {MASK_KEY!r} in TRL's step output")
    mask = to_numpy(output[MASK_KEY], MASK_KEY).astype(bool)
    if output.get(TOOL_MASK_KEY) is not None:
        mask &= to_numpy(output[TOOL_MASK_KEY], TOOL_MASK_KEY).astype(bool)
    return mask


def quarantined_rows(ids: Sequence[str], quarantined: Iterable[Any]) -> list[int]:
    """The rows (positions in `ids`, this process's request ids in row order) of the quarantined
    sequences (`rlcheck.core.quarantine.Quarantined`, matched by `request_id`), ascending."""
    row_of = {rid: i for i, rid in enumerate(ids)}
    return sorted(row_of[q.request_id] for q in quarantined)


def mask_rows(output: dict[str, Any], rows: Sequence[int]) -> int:
    """Zero `rows` of `output["completion_mask"]` (a new tensor in the dict; the old one may be
    shared) and return how many loss tokens (completion x tool mask) they held."""
    if not rows:
        return 0
    dropped = int(response_mask(output)[list(rows)].sum())
    mask = output[MASK_KEY].clone()  # (B, C)
    mask[list(rows)] = 0
    output[MASK_KEY] = mask
    return dropped


def _prompt_tokens(output: Mapping[str, Any]) -> list[np.ndarray] | None:
    ids, mask = output.get("prompt_ids"), output.get("prompt_mask")
    if ids is None or mask is None:
        return None
    p = to_numpy(ids, "prompt_ids").astype(np.int64)  # (B, P)
    keep = to_numpy(mask, "prompt_mask").astype(bool)  # (B, P)
    if p.shape != keep.shape:
        return None
    return [row[k] for row, k in zip(p, keep, strict=True)]


def to_step_batch(output: Mapping[str, Any], ids: Sequence[str], *, logp_train: Any = None,
                  meta: Mapping[str, Sequence[Any]] | None = None, weight_version: int | None = None,
                  topk: Any = None) -> StepBatch:
    """The `StepBatch` of one process's TRL step output: vLLM's sampling logprobs against the trainer's
    raw `old_per_token_logps` (or `logp_train`) on the response mask, one sequence per row;
    `weight_version`: the step vLLM's weights were last synced at (every row's); `topk`: a
    `rlcheck.core.topk.TopK` of B*C rows, row b*C + t for completion position (b, t)."""
    rollout = output.get(ROLLOUT_KEY)
    if rollout is None:
        raise InputError(
            f"no {ROLLOUT_KEY!r} in TRL's step output: TRL keeps the sampling logprobs only with "
            "use_vllm=True; rlcheck has nothing to compare without them"
        )
    train = output.get(TRAIN_KEY) if logp_train is None else logp_train
    if train is None:
        raise InputError(f"no {TRAIN_KEY!r} in TRL's step output: pass logp_train=")
    completion = output.get("completion_ids")
    return StepBatch.from_padded(
        rollout,
        train,
        response_mask(output),
        ids,
        tokens=None if completion is None else to_numpy(completion, "completion_ids").astype(np.int64),
        prompt_tokens=_prompt_tokens(output),
        meta=meta,
        weight_version=weight_version,
        topk=topk,
    )


def new_scalars(before: Mapping[str, int], metrics: Mapping[str, Sequence[float]],
                prefixes: Iterable[str] = FORWARD_PREFIXES) -> dict[str, float]:
    """The mean of the values TRL appended to `metrics` (its `_metrics[mode]` lists) since `before`
    (their lengths then), for keys under `prefixes`, finite only, as `trl/<key>`."""
    starts = tuple(prefixes)
    out = {}
    for key, values in metrics.items():
        if not key.startswith(starts):
            continue
        fresh = [float(v) for v in list(values)[before.get(key, 0):] if v is not None]
        fresh = [v for v in fresh if np.isfinite(v)]
        if fresh:
            out[f"trl/{key}"] = float(np.mean(fresh))
    return out
