"""Quarantine over every rank (see `rlcheck.distributed`): each rank judges its own sequences as one
process judging the whole step would. The step-wide parts of the verdict are the whole step's: the
burst of early divergences is decided on counts summed over the ranks (`rlcheck.core.quarantine
.burst_counts`), at the early-burst levels of rank 0's Monitor (its `SignatureConfig`), with rank 0's
trainer version and every rank's alarms; the quarantined fraction is the step's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.detect.signature import SignatureConfig
from rlcheck.core.quarantine import (
    QuarantineConfig,
    Verdict,
    burst_counts,
    is_burst,
    judge,
    kept_partial,
    per_sequence_flags,
)
from rlcheck.core.stats import PartialStats, StatsConfig, compute_partial, empty_partial
from rlcheck.core.types import Alarm
from rlcheck.distributed.failures import RankGuard
from rlcheck.distributed.reduce import root

_NO_COUNTS = np.zeros(5, dtype=np.float64)


def merge_verdicts(verdicts: Sequence[Verdict]) -> Verdict:
    """One verdict of the ranks' batches joined in rank order: `keep` concatenated, each rank's
    quarantined sequences indexed past the preceding ranks' sequences."""
    offsets = np.cumsum([0] + [v.keep.shape[0] for v in verdicts[:-1]])  # (R,)
    quarantined = tuple(replace(q, index=q.index + int(off)) for v, off in zip(verdicts, offsets, strict=True)
                        for q in v.quarantined)
    return Verdict(np.concatenate([v.keep for v in verdicts]), quarantined,
                   sum(v.num_tokens for v in verdicts), sum(v.total_tokens for v in verdicts),
                   sum(v.burst_only for v in verdicts))


def judge_across_ranks(batch: StepBatch | None, stats: StatsConfig, cfg: QuarantineConfig, max_weight_lag: int,
                       trainer_version: int | None, alarms: Sequence[Alarm], signature: SignatureConfig | None,
                       group: Any, guard: RankGuard) -> tuple[PartialStats, Verdict, Verdict | None, StepBatch | None]:
    """Every rank's sequences judged by `cfg` (a collective; `trainer_version` and `signature`: rank 0's,
    `alarms`: the step's, the same on every rank): (this rank's statistics, of the sequences it keeps
    when the step's quarantined fraction is within `max_frac`, else of all; its own verdict; on rank 0
    the merged verdict and every rank's quarantined sequences in its order, else None). A rank's
    failure (`guard`) is raised on every rank at the next exchange."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flags = None if batch is None else guard.call(per_sequence_flags, batch, stats)
    # each rank's burst counts; rank 0's trainer version and signature
    shared = guard.exchange((_NO_COUNTS if flags is None else burst_counts(flags), trainer_version, signature))
    _, trainer_version, signature = shared[0]
    burst = is_burst(np.sum([counts for counts, _, _ in shared], axis=0), signature)  # the whole step's
    own = Verdict(np.zeros(0, dtype=bool), (), 0, 0)
    if batch is not None:
        own = guard.call(lambda: judge(batch, stats, cfg, trainer_version=trainer_version, max_weight_lag=max_weight_lag,
                                       alarms=alarms, flags=flags, burst=burst), default=own)
    merged = merge_verdicts(guard.exchange(own))
    if batch is None:
        partial = empty_partial(stats)
    elif own.count and merged.frac <= cfg.max_frac:
        partial = guard.call(kept_partial, batch, own, stats, default=empty_partial(stats))
    else:
        partial = guard.call(compute_partial, batch, stats, default=empty_partial(stats))
    if merged.count == 0:
        return partial, own, merged if rank == 0 else None, None
    mine = guard.call(batch.select, [q.index for q in own.quarantined]) if own.count else None
    held: list | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, held, dst=root(group), group=group)
    if rank != 0:
        return partial, own, None, None
    return partial, own, merged, StepBatch.concat([b for b in held if b is not None])
