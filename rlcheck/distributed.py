"""Cross-rank reduction of `PartialStats` with torch.distributed (gloo or NCCL).

Every rank computes `compute_partial` on its own sequences, then

    partial = all_reduce_partial(partial)      # same result on every rank
    metrics, offenders = finalize(partial, cfg)

gives every rank the metrics of the whole batch, as if one process had seen it: sums are all-reduced
with SUM and divided once in `finalize` (never an average of per-rank means), extrema with MAX / MIN,
histograms with SUM. The small parts (offenders, sequence counts, key layout) travel with
`all_gather_object` and are combined by `rlcheck.stats.merge`, so offender indices count from the
start of the global batch in rank order (rank 0's sequences first). torch is imported lazily here.
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from rlcheck.errors import ConfigError
from rlcheck.stats import PartialStats, merge

_PER_RANK = ("sums", "maxima", "minima", "hists", "offenders", "num_sequences")


def _layout(p: PartialStats) -> tuple:
    """What must agree across ranks: the keys and bins of the reduced tensors (so they line up key
    by key) and every other field (thresholds, top_k: the configuration)."""
    hist_shapes = tuple((k, p.hists[k].shape) for k in sorted(p.hists))
    shared = tuple((f.name, getattr(p, f.name)) for f in fields(p) if f.name not in _PER_RANK)
    return sorted(p.sums), sorted(p.maxima), sorted(p.minima), hist_shapes, shared


def _reduce(values: dict[str, float], op, group, device) -> dict[str, float]:
    """One float64 all-reduce of a dict of scalars, keys in sorted order."""
    import torch
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)  # (K,)
    dist.all_reduce(t, op=op, group=group)
    return dict(zip(keys, t.cpu().tolist(), strict=True))


def _reduce_hists(hists: dict[str, np.ndarray], group, device) -> dict[str, np.ndarray]:
    """All histograms summed in one int64 all-reduce (exact counts)."""
    import torch
    import torch.distributed as dist

    keys = sorted(hists)
    sizes = [hists[k].shape[0] for k in keys]
    flat = np.concatenate([hists[k].astype(np.int64) for k in keys]) if keys else np.zeros(0, np.int64)
    t = torch.from_numpy(flat).to(device)  # (sum of bins,) int64
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    parts = np.split(t.cpu().numpy(), np.cumsum(sizes)[:-1])
    return dict(zip(keys, parts, strict=True))


def all_reduce_partial(partial: PartialStats, group=None, top_k: int | None = None) -> PartialStats:
    """The statistics of all ranks' sequences combined, returned on every rank (a collective: every
    rank of `group` must call it). `top_k` bounds the merged offenders, as in `merge`."""
    import torch
    import torch.distributed as dist

    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    small = (_layout(partial), partial.offenders, partial.num_sequences)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, small, group=group)
    layouts = [g[0] for g in gathered]
    if any(lay != layouts[0] for lay in layouts):
        raise ConfigError(
            "all_reduce_partial: ranks hold statistics of different layouts (keys, thresholds, top_k "
            "or histogram bins differ); every rank must use the same StatsConfig"
        )

    # Offenders and sequence counts through `merge` (rank order, index offsets); heavy fields empty.
    empty = {"sums": {}, "maxima": {}, "minima": {}, "hists": {}}
    light = [replace(partial, **empty, offenders=offs, num_sequences=num) for _, offs, num in gathered]
    merged = merge(light, top_k=top_k)
    return replace(
        merged,
        sums=_reduce(partial.sums, dist.ReduceOp.SUM, group, device),
        maxima=_reduce(partial.maxima, dist.ReduceOp.MAX, group, device),
        minima=_reduce(partial.minima, dist.ReduceOp.MIN, group, device),
        hists=_reduce_hists(partial.hists, group, device),
    )
