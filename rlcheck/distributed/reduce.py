"""Cross-rank reduction of `PartialStats` (see `rlcheck.distributed`), and the small collectives the
Monitor step over every rank is built of. torch is imported lazily here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np

from rlcheck.core.stats import PartialStats, merge
from rlcheck.core.types import Alarm
from rlcheck.errors import ConfigError

_PER_RANK = ("sums", "maxima", "minima", "hists", "offenders", "num_sequences", "versions")


def _layout(p: PartialStats) -> tuple:
    """What must agree across ranks: the keys and bins of the reduced tensors (so they line up key
    by key) and every other field (thresholds, top_k: the configuration)."""
    hist_shapes = tuple((k, p.hists[k].shape) for k in sorted(p.hists))
    shared = tuple((f.name, getattr(p, f.name)) for f in fields(p) if f.name not in _PER_RANK)
    return sorted(p.sums), sorted(p.maxima), sorted(p.minima), hist_shapes, shared


def _difference(layouts: list[tuple]) -> str:
    """Where the first rank whose layout differs from rank 0's does: the keys one of them lacks, or the field."""
    rank = next(r for r, lay in enumerate(layouts) if lay != layouts[0])
    names = ("sum keys", "max keys", "min keys", "histograms")
    for name, a, b in zip(names, layouts[0][:4], layouts[rank][:4], strict=True):
        if a != b:
            return f"{name}: rank 0 alone has {sorted(set(a) - set(b))}, rank {rank} alone {sorted(set(b) - set(a))}"
    fields_differ = [a[0] for a, b in zip(layouts[0][4], layouts[rank][4], strict=True) if a != b]
    return f"rank 0 and rank {rank} differ in {fields_differ}"


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

    small = (_layout(partial), partial.offenders, partial.num_sequences, partial.versions)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, small, group=group)
    layouts = [g[0] for g in gathered]
    if any(lay != layouts[0] for lay in layouts):
        raise ConfigError("all_reduce_partial: ranks hold statistics of different layouts; every rank must use "
                          f"the same StatsConfig and batch fields ({_difference(layouts)})")

    # Offenders, sequence counts and weight versions through `merge` (rank order, index offsets);
    # heavy fields empty.
    empty = {"sums": {}, "maxima": {}, "minima": {}, "hists": {}}
    light = [replace(partial, **empty, offenders=offs, num_sequences=num, versions=versions)
             for _, offs, num, versions in gathered]
    merged = merge(light, top_k=top_k)
    return replace(
        merged,
        sums=_reduce(partial.sums, dist.ReduceOp.SUM, group, device),
        maxima=_reduce(partial.maxima, dist.ReduceOp.MAX, group, device),
        minima=_reduce(partial.minima, dist.ReduceOp.MIN, group, device),
        hists=_reduce_hists(partial.hists, group, device),
    )


def all_ranks_agree(flag: bool, device: Any = "cpu", group: Any = None) -> bool:
    """True when `flag` holds on every rank (one MIN all-reduce; `device` cuda under NCCL)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def root(group: Any) -> int:
    """The global rank of `group`'s rank 0 (the collectives below name their source globally)."""
    import torch.distributed as dist

    return 0 if group is None else dist.get_global_rank(group, 0)


def broadcast(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank of `group`."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=root(group), group=group)
    return box[0]


def gather_alarms(alarms: Sequence[Alarm], group: Any = None) -> list[Alarm]:
    """Every rank's alarms found outside the Monitor (its own engine's failed sync check), on every
    rank, in rank order; another rank's name it in their message and `details["rank"]`."""
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(alarms), group=group)
    return [a if r == 0 else replace(a, message=f"rank {r}: {a.message}", details={**a.details, "rank": r})
            for r, part in enumerate(parts) for a in part]
