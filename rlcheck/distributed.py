"""Cross-rank reduction of `PartialStats` with torch.distributed (gloo or NCCL).

Every rank computes `compute_partial` on its own sequences, then

    partial = all_reduce_partial(partial)      # same result on every rank
    metrics, offenders = finalize(partial, cfg)

gives every rank the metrics of the whole batch, as if one process had seen it: sums are all-reduced
with SUM and divided once in `finalize` (never an average of per-rank means), extrema with MAX / MIN,
histograms with SUM. The small parts (offenders, sequence counts, key layout) travel with
`all_gather_object` and are combined by `rlcheck.core.stats.merge`, so offender indices count from the
start of the global batch in rank order (rank 0's sequences first).

One Monitor step over every rank, the way a distributed trainer should call it:

    monitor = Monitor(cfg) if rank == 0 else None          # one Monitor per run, on rank 0
    report = observe_across_ranks(monitor, step, batch, cfg.stats)   # every rank, every step

`observe_across_ranks` is a collective: it reduces the ranks' statistics, rank 0's Monitor judges the
step, and its verdict is broadcast, so every rank returns the same `StepReport` or raises together
(a rank that went on training alone would hang in its next collective). On a halt every rank's
sequences are gathered to rank 0, which writes one dump of the whole step, and every rank raises
`MismatchHalt` (same report, reason and dump dir). An error in rank 0's Monitor reaches every rank
too: rank 0 raises it, the others raise it as well when it can be named (an error class of
`rlcheck.errors` built from its message; it travels as plain data, its class name and message), otherwise
an `RLCheckError` naming it. A rank with nothing to compare passes `batch=None`. `all_ranks_agree`
is the one-flag vote for deciding together whether to observe at all. torch is imported lazily here.

Quarantine (`quarantine=QuarantineConfig(...)`, the Monitor's `cfg.quarantine`): each rank judges its
own sequences (`rlcheck.core.quarantine.judge`, with rank 0's trainer version and alarms), the ranks
agree on the step's quarantined fraction, and within `max_frac` each reduces the statistics of the
sequences it keeps. Rank 0's Monitor gets one verdict of every rank's sequences (rank order, as the
offenders count them) and the quarantined sequences themselves, for their dump. Every rank's report
then says which of its own sequences to train on: `keep` ((N,) bool, its batch order), `quarantined`
(indices in its batch) and `batch` are the rank's own; the metrics count the whole step.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np

from rlcheck import errors
from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import Monitor
from rlcheck.core.quarantine import QuarantineConfig, Verdict, judge, kept_partial
from rlcheck.core.stats import PartialStats, StatsConfig, compute_partial, empty_partial, merge
from rlcheck.core.types import Alarm, StepReport
from rlcheck.errors import ConfigError, MismatchHalt, RLCheckError

__all__ = ["all_ranks_agree", "all_reduce_partial", "observe_across_ranks"]

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

    small = (_layout(partial), partial.offenders, partial.num_sequences, partial.versions)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, small, group=group)
    layouts = [g[0] for g in gathered]
    if any(lay != layouts[0] for lay in layouts):
        raise ConfigError(
            "all_reduce_partial: ranks hold statistics of different layouts (keys, thresholds, top_k "
            "or histogram bins differ); every rank must use the same StatsConfig"
        )

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


# ---- one Monitor step over every rank ------------------------------------------------------------


def all_ranks_agree(flag: bool, device: Any = "cpu", group: Any = None) -> bool:
    """True when `flag` holds on every rank (one MIN all-reduce; `device` cuda under NCCL)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _root(group: Any) -> int:
    """The global rank of `group`'s rank 0 (the collectives below name their source globally)."""
    import torch.distributed as dist

    return 0 if group is None else dist.get_global_rank(group, 0)


def _broadcast(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank of `group`."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=_root(group), group=group)
    return box[0]


def _sendable(exc: Exception) -> str | None:
    """The name of `exc`'s class when the other ranks can raise it too, else None: a class of
    `rlcheck.errors` that rebuilds the same error from its message alone. Only plain data (the
    name and the message) crosses ranks, never the exception object: the receiver looks the name up
    among rlcheck's own error classes (`_rebuild`), so nothing a rank sends is executed."""
    name = type(exc).__name__
    if not isinstance(exc, RLCheckError) or getattr(errors, name, None) is not type(exc):
        return None
    try:
        copy = type(exc)(str(exc))
    except Exception:  # a richer constructor (RecordWriteError, ActorDiedError, ...)
        return None
    return name if str(copy) == str(exc) else None


def _rebuild(name: str | None, message: str, step: int) -> RLCheckError:
    """Rank 0's error on another rank: the `rlcheck.errors` class `name` from its message, or (None) an
    `RLCheckError` naming it."""
    cls = getattr(errors, name, None) if name is not None else None
    if isinstance(cls, type) and issubclass(cls, RLCheckError):
        return cls(message)
    return RLCheckError(f"rlcheck stopped on rank 0 at step {step}: {message}")


def _verdict(monitor: Monitor | None, step: int, partial: PartialStats, extra: Mapping[str, float] | None,
             trainer_version: int | None = None, alarms: Sequence[Alarm] = (), verdict: Verdict | None = None,
             quarantine_batch: StepBatch | None = None) -> tuple[tuple, MismatchHalt | Exception | None]:
    """Rank 0: what its Monitor said of the step, as the message every rank receives, and the
    exception it raised (None when the step passed)."""
    if monitor is None:
        error = ConfigError("observe_across_ranks: rank 0 must pass the run's Monitor, it passed None")
        return ("error", _sendable(error), str(error)), error
    if (verdict is None) != (monitor.cfg.quarantine is None):
        error = ConfigError("observe_across_ranks: pass quarantine=monitor.cfg.quarantine (the same on every "
                            f"rank); the Monitor's quarantine is {monitor.cfg.quarantine}, the call's "
                            f"{'off' if verdict is None else 'on'}")
        return ("error", _sendable(error), str(error)), error
    try:
        return ("ok", monitor.observe_partial(step, partial, None, extra, alarms, trainer_version=trainer_version,
                                              verdict=verdict, quarantine_batch=quarantine_batch)), None
    except MismatchHalt as halt:
        return ("halt", halt.report, halt.reason, halt.problems), halt
    except Exception as exc:  # every rank must hear of it, or they wait for rank 0 forever
        name = _sendable(exc)
        return ("error", name, str(exc) if name else f"{type(exc).__name__}: {exc}"), exc


def _dump_all(monitor: Monitor | None, step: int, batch: StepBatch | None, report: StepReport,
              reason: str, group: Any = None) -> tuple[str | None, tuple[str, ...]]:
    """Every rank's sequences gathered to rank 0, which writes the step's one dump: (its path, what
    went wrong), the same on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    batches: list | None = [None] * world if rank == 0 else None
    dist.gather_object(batch, batches, dst=_root(group), group=group)
    where, problems = None, ()
    if rank == 0 and monitor is not None and monitor.cfg.halt.dump:
        held = [b for b in batches if b is not None]
        try:
            where = str(monitor.dump(step, StepBatch.concat(held), report, reason=reason)) if held else None
        except Exception as exc:  # the halt matters more than its evidence
            problems = (f"the dump could not be written ({type(exc).__name__}: {exc})",)
            warnings.warn(f"rlcheck: the dump of step {step} failed ({exc})", RuntimeWarning, stacklevel=3)
    return _broadcast((where, problems), group)


# ---- quarantine over every rank -----------------------------------------------------------------


def _merge_verdicts(verdicts: Sequence[Verdict]) -> Verdict:
    """One verdict of the ranks' batches joined in rank order: `keep` concatenated, each rank's
    quarantined sequences indexed past the preceding ranks' sequences."""
    offsets = np.cumsum([0] + [v.keep.shape[0] for v in verdicts[:-1]])  # (R,)
    quarantined = tuple(replace(q, index=q.index + int(off)) for v, off in zip(verdicts, offsets, strict=True)
                        for q in v.quarantined)
    return Verdict(np.concatenate([v.keep for v in verdicts]), quarantined,
                   sum(v.num_tokens for v in verdicts), sum(v.total_tokens for v in verdicts),
                   sum(v.burst_only for v in verdicts))


def _judge_across_ranks(batch: StepBatch | None, stats: StatsConfig, cfg: QuarantineConfig, max_weight_lag: int,
                        trainer_version: int | None, alarms: Sequence[Alarm], group: Any = None,
                        ) -> tuple[PartialStats, Verdict, Verdict | None, StepBatch | None]:
    """Every rank's sequences judged by `cfg` (a collective): (this rank's statistics, of the sequences
    it keeps when the step's quarantined fraction is within `max_frac`, else of all; its own verdict;
    on rank 0 the merged verdict and every rank's quarantined sequences in its order, else None)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    trainer_version, alarms = _broadcast((trainer_version, list(alarms)), group)  # rank 0's, as the Monitor's
    if batch is None:
        own = Verdict(np.zeros(0, dtype=bool), (), 0, 0)
    else:
        own = judge(batch, stats, cfg, trainer_version=trainer_version, max_weight_lag=max_weight_lag, alarms=alarms)
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, own, group=group)
    merged = _merge_verdicts(verdicts)
    if batch is None:
        partial = empty_partial(stats)
    elif own.count and merged.frac <= cfg.max_frac:
        partial = kept_partial(batch, own, stats)
    else:
        partial = compute_partial(batch, stats)
    if merged.count == 0:
        return partial, own, merged if rank == 0 else None, None
    mine = batch.select([q.index for q in own.quarantined]) if own.count else None
    held: list | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, held, dst=_root(group), group=group)
    if rank != 0:
        return partial, own, None, None
    return partial, own, merged, StepBatch.concat([b for b in held if b is not None])


def _own_part(report: StepReport, batch: StepBatch | None, own: Verdict | None) -> StepReport:
    """`report` (the step's, from rank 0) with this rank's keep, quarantined sequences and batch."""
    if own is not None:
        report.keep, report.quarantined = own.keep, own.quarantined
    else:
        report.keep, report.quarantined = None if batch is None else np.ones(batch.num_sequences, dtype=bool), ()
    report.batch = batch
    return report


def observe_across_ranks(monitor: Monitor | None, step: int, batch: StepBatch | None, stats: StatsConfig,
                         extra: Mapping[str, float] | None = None, group: Any = None, *,
                         trainer_version: int | None = None, alarms: Sequence[Alarm] = (),
                         quarantine: QuarantineConfig | None = None, max_weight_lag: int = 0) -> StepReport:
    """One Monitor step over every rank of `group` (a collective: each rank calls it with its own
    `batch`, a `StepBatch`, or None when it has nothing to compare). `monitor`: rank 0's Monitor
    (the other ranks pass None; theirs is not used); `stats`: the same `StatsConfig` on every rank
    (the Monitor's `cfg.stats`); `extra`: rank 0's scalars for the step; `trainer_version`: rank 0's,
    compared with every rank's sequences' `weight_version`; `alarms`: rank 0's, found outside the
    Monitor (a failed sync check), judged with the step's; `quarantine` and `max_weight_lag`: the
    Monitor's `cfg.quarantine` and `cfg.max_weight_lag`, the same on every rank (see the module
    docstring). Returns rank 0's `StepReport` on every rank, with the rank's own `keep`,
    `quarantined` and `batch`; raises `MismatchHalt` on every rank when rank 0's Monitor halts,
    after one dump of every rank's sequences; raises on every rank when rank 0's Monitor fails."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    own = merged = quarantined = None
    if quarantine is not None:
        partial, own, merged, quarantined = _judge_across_ranks(batch, stats, quarantine, max_weight_lag,
                                                                trainer_version, alarms, group)
    else:
        partial = compute_partial(batch, stats) if batch is not None else empty_partial(stats)
    partial = all_reduce_partial(partial, group, top_k=stats.top_k)
    said, raised = (_verdict(monitor, step, partial, extra, trainer_version, alarms, merged, quarantined)
                    if rank == 0 else (None, None))
    said = _broadcast(said, group)
    if said[0] == "ok":
        return _own_part(said[1], batch, own)
    if said[0] == "error":
        _, name, message = said
        if raised is not None:
            raise raised
        raise _rebuild(name, message, step)
    _, report, reason, problems = said
    where, more = _dump_all(monitor if rank == 0 else None, step, batch, report, reason, group)
    raise MismatchHalt(_own_part(report, batch, own), reason, where, tuple(problems) + tuple(more)) from raised
