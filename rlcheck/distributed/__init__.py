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
an `RLCheckError` naming it. A rank with nothing to compare passes `batch=None`; a batch's device tensors never cross ranks
(the dump gathers host arrays). `all_ranks_agree`
is the one-flag vote for deciding together whether to observe at all. torch is imported lazily here.

Alarms found outside the Monitor (`alarms=`: a rank's own engine failed its sync check) are every
rank's: each rank passes its own, rank 0's Monitor judges them all (another rank's named in the message).

Quarantine (`quarantine=QuarantineConfig(...)`, the Monitor's `cfg.quarantine`): each rank judges its
own sequences as one process judging the whole step would (`rlcheck.distributed.quarantine`: the
early burst decided on the whole step's counts at rank 0's Monitor's `SignatureConfig`, rank 0's
trainer version, every rank's alarms), the ranks agree on the step's quarantined fraction, and within
`max_frac` each reduces the statistics of the sequences it keeps. Rank 0's Monitor gets one verdict of every rank's sequences (rank order, as the
offenders count them) and the quarantined sequences themselves, for their dump. Every rank's report
then says which of its own sequences to train on: `keep` ((N,) bool, its batch order), `quarantined`
(indices in its batch) and `batch` are the rank's own; the metrics count the whole step.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rlcheck import errors
from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import Monitor
from rlcheck.core.quarantine import QuarantineConfig, Verdict
from rlcheck.core.stats import PartialStats, StatsConfig, compute_partial, empty_partial
from rlcheck.core.types import Alarm, StepReport
from rlcheck.distributed.quarantine import judge_across_ranks
from rlcheck.distributed.reduce import all_ranks_agree, all_reduce_partial, broadcast, gather_alarms, root
from rlcheck.errors import ConfigError, MismatchHalt, RLCheckError

__all__ = ["all_ranks_agree", "all_reduce_partial", "observe_across_ranks"]


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
    dist.gather_object(_host(batch), batches, dst=root(group), group=group)
    where, problems = None, ()
    if rank == 0 and monitor is not None and monitor.cfg.halt.dump:
        held = [b for b in batches if b is not None]
        try:
            where = str(monitor.dump(step, StepBatch.concat(held), report, reason=reason)) if held else None
        except Exception as exc:  # the halt matters more than its evidence
            problems = (f"the dump could not be written ({type(exc).__name__}: {exc})",)
            warnings.warn(f"rlcheck: the dump of step {step} failed ({exc})", RuntimeWarning, stacklevel=3)
    return broadcast((where, problems), group)


def _host(batch: StepBatch | None) -> StepBatch | None:
    """`batch` without its device tensors (a rank's GPU tensors would be unpickled onto rank 0's GPUs)."""
    return replace(batch) if batch is not None and batch.device_tensors is not None else batch


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
    compared with every rank's sequences' `weight_version`; `alarms`: this rank's, found outside the
    Monitor (its engine's failed sync check), every rank's judged with the step's; `quarantine` and `max_weight_lag`: the
    Monitor's `cfg.quarantine` and `cfg.max_weight_lag`, the same on every rank (see the module
    docstring). Returns rank 0's `StepReport` on every rank, with the rank's own `keep`,
    `quarantined` and `batch`; raises `MismatchHalt` on every rank when rank 0's Monitor halts,
    after one dump of every rank's sequences; raises on every rank when rank 0's Monitor fails."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    own = merged = quarantined = None
    alarms = gather_alarms(alarms, group)
    if quarantine is not None:
        signature = monitor.cfg.detectors.signature if rank == 0 and monitor is not None else None
        partial, own, merged, quarantined = judge_across_ranks(batch, stats, quarantine, max_weight_lag,
                                                               trainer_version, alarms, signature, group)
    else:
        partial = compute_partial(batch, stats) if batch is not None else empty_partial(stats)
    partial = all_reduce_partial(partial, group, top_k=stats.top_k)
    said, raised = (_verdict(monitor, step, partial, extra, trainer_version, alarms, merged, quarantined)
                    if rank == 0 else (None, None))
    said = broadcast(said, group)
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
