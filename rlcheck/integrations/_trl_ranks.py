"""One Monitor step over every process of a torch.distributed run (accelerate launches TRL that way).

Every rank computes `compute_partial` on its own sequences and `all_reduce_partial` combines them
(sums, extrema, histograms; never an average of per-rank means). Rank 0 alone holds the Monitor and
calls `observe_partial`; its verdict is broadcast so that every rank returns or raises together (a
rank that kept training would hang in the next collective). On a halt every rank's sequences are
gathered to rank 0, which writes the dump of the whole step (offender indices count from rank 0's
first sequence, as in the reduction), then every rank raises `MismatchHalt`. torch is imported here
only when called.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from rlcheck.batch import StepBatch
from rlcheck.distributed import all_reduce_partial
from rlcheck.errors import MismatchHalt, RLCheckError
from rlcheck.integrations._trl_batch import concat_batches
from rlcheck.monitor import Monitor, StepReport
from rlcheck.stats import StatsConfig, compute_partial


def _broadcast(obj: Any, group: Any = None) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_ranks_agree(flag: bool, device: Any = "cpu", group: Any = None) -> bool:
    """True when `flag` holds on every rank (one MIN all-reduce; `device` cuda under NCCL)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _verdict(monitor: Monitor | None, step: int, partial: Any, extra: Mapping[str, float] | None):
    """Rank 0: (report, halt, error) of its Monitor's step; the others: (None, None, None)."""
    if monitor is None:
        return None, None, None
    try:
        return monitor.observe_partial(step, partial, None, extra), None, None
    except MismatchHalt as halt:
        return None, halt, None
    except Exception as exc:  # every rank must hear of it, or they wait for rank 0 forever
        return None, None, exc


def _dump_all(monitor: Monitor | None, step: int, batch: StepBatch, halt: MismatchHalt | None,
              group: Any = None) -> str | None:
    """Gather every rank's sequences to rank 0, which writes the step's dump; its path on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    batches: list | None = [None] * world if rank == 0 else None
    dist.gather_object(batch, batches, dst=0, group=group)
    where = None
    if rank == 0 and monitor is not None and halt is not None and monitor.cfg.halt.dump:
        try:
            where = str(monitor.dump(step, concat_batches(batches), halt.report, reason=halt.reason))
        except Exception as exc:  # the halt matters more than its evidence
            warnings.warn(f"rlcheck: the dump of step {step} failed ({exc})", RuntimeWarning, stacklevel=2)
    return _broadcast(where, group)


def observe_across_ranks(monitor: Monitor | None, step: int, batch: StepBatch, stats: StatsConfig,
                         extra: Mapping[str, float] | None = None, group: Any = None) -> StepReport | None:
    """A collective: every rank of `group` calls it with its own `batch`; `monitor` is rank 0's (None
    elsewhere) and `stats` the same `StatsConfig` everywhere. Returns rank 0's `StepReport` (None on
    the other ranks); raises `MismatchHalt` on every rank when rank 0's Monitor halts."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    partial = all_reduce_partial(compute_partial(batch, stats), group, top_k=stats.top_k)
    report, halt, error = _verdict(monitor if rank == 0 else None, step, partial, extra)
    if halt is not None:
        said = ("halt", halt.reason)
    else:
        said = None if error is None else ("error", f"{type(error).__name__}: {error}")
    said = _broadcast(said, group)
    if said is None:
        return report
    kind, message = said
    if kind == "error":
        if error is not None:
            raise error
        raise RLCheckError(f"rlcheck stopped on rank 0 at step {step}: {message}")
    where = _dump_all(monitor if rank == 0 else None, step, batch, halt, group)
    if halt is not None:  # rank 0: the same halt, with the dump of every rank's sequences
        raise MismatchHalt(halt.report, halt.reason, where) from halt
    raise MismatchHalt(StepReport(step, {}, [], (), halted=True, halt_reason=message), message, where)
