"""verl's fully async trainer (`verl.experimental.fully_async_policy`, verl 0.9): which rows rlcheck
compares, and how far behind the trainer they may be, from verl's own settings.

What verl does (fully_async_rollouter.py, fully_async_trainer.py): the rollouter stamps each trajectory
with `min_global_steps` / `max_global_steps`, the parameter versions its first and last tokens were
generated on; with `async_training.partial_rollout` a generation a sync interrupts resumes on the new
weights (min < max). The trainer recomputes `old_log_probs` with the weights of its
`current_param_version` (the copy it saved at that version's first step, `_compute_old_log_prob`), so a
row generated on older weights differs from it by the policy's change over the lag, by design, not
only by numerics. rlcheck therefore compares the rows generated entirely on the trainer's version
(min = max = V) and leaves the lagged ones out of its statistics (their tokens masked, counted in
`verl_async/lagged_frac`); every row's lag is checked against the bound below (a critical `weights`
alarm past it, as for a missed sync).

The bound, from verl's settings: per parameter version the trainer consumes W = required_samples x
`trigger_parameter_sync_step` samples; the rollouter stops generating while the samples it holds
(queued and in flight) reach (1 + `staleness_threshold`) x W (`max_required_samples`). A sample waits
behind at most that many, consumed W a version, so it is trained on at most ceil(staleness_threshold)
versions after the one it was generated on; a partial rollout resumed across a sync started one version
earlier still. `max_lag = ceil(staleness_threshold) + partial_rollout` (`staleness_threshold` is a
fraction of samples, not itself a lag). Not run here: the fully async trainer needs GPUs; the tests feed
rlcheck real `DataProto`s shaped as it assembles them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.weights import check_versions
from rlcheck.errors import ConfigError, InputError

LAGGED_FRAC = "verl_async/lagged_frac"
"""Share of the step's rows generated (partly) on weights older than the trainer's, left out of the statistics."""
MAX_LAG = "verl_async/max_lag"
STALE_COUNT = "verl_async/stale_count"
"""The step's oldest row's lag, and the rows past the bound (logged beside rlcheck's metrics)."""
MAX_VERSION_KEY = "max_global_steps"


def fully_async_max_lag(async_training: Any) -> int:
    """The versions a row may lag the trainer's in verl's fully async trainer, from its
    `async_training` settings (an omegaconf node or a mapping; verl's defaults where a key is absent)."""
    get = async_training.get if hasattr(async_training, "get") else (lambda k, d: getattr(async_training, k, d))
    threshold = get("staleness_threshold", 1)
    if threshold is None or float(threshold) < 0:
        raise ConfigError(f"async_training.staleness_threshold must be >= 0, got {threshold!r}")
    return math.ceil(float(threshold)) + int(bool(get("partial_rollout", True)))


def on_version(batch: StepBatch, non_tensors: Mapping[str, Any], step: int, param_version: int,
               max_lag: int) -> tuple[StepBatch, dict[str, float], list]:
    """(`batch` with the rows not generated entirely on `param_version` masked out, the step's lag
    metrics, the `weights` alarm of rows past `max_lag`)."""
    if batch.weight_version is None or MAX_VERSION_KEY not in non_tensors:
        raise InputError("fully async: the batch needs verl's min_global_steps and max_global_steps for every row")
    first = np.asarray(batch.weight_version, dtype=np.int64)  # (N,)
    last = np.asarray(list(np.asarray(non_tensors[MAX_VERSION_KEY], dtype=object).reshape(-1)), dtype=np.int64)
    if last.shape != first.shape:
        raise InputError(f"non_tensor_batch[{MAX_VERSION_KEY!r}] has {last.shape[0]} entries for {first.shape[0]} rows")
    versions: dict[int, tuple[int, tuple[str, ...]]] = {}
    for v in np.unique(first).tolist():
        rows = np.flatnonzero(first == v)
        versions[int(v)] = (int(rows.size), tuple(batch.request_ids[i] for i in rows[:20]))
    found, alarms = check_versions(step, versions, param_version, max_lag)
    metrics = {MAX_LAG: found[K.WEIGHTS_MAX_LAG], STALE_COUNT: found[K.WEIGHTS_STALE_COUNT]}
    current = (first == param_version) & (last == param_version)  # (N,)
    tokens = np.repeat(current, np.diff(batch.cu_seqlens))  # (M,)
    mask = tokens if batch.mask is None else batch.mask & tokens
    metrics[LAGGED_FRAC] = float(1.0 - current.mean()) if current.size else 0.0
    return dataclasses.replace(batch, mask=mask), metrics, alarms
