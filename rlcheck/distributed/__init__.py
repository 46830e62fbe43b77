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

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.batch_tally import batch_tally
from rlcheck.core.correction import PREFIX, Correction, CorrectionConfig
from rlcheck.core.monitor import Monitor
from rlcheck.core.quarantine import QuarantineConfig, Verdict
from rlcheck.core.stats import PartialStats, StatsConfig, compute_partial, empty_partial
from rlcheck.core.tally import Tally
from rlcheck.core.types import Alarm, StepReport
from rlcheck.distributed.failures import RankGuard, describe, rebuild
from rlcheck.distributed.quarantine import judge_across_ranks
from rlcheck.distributed.reduce import all_ranks_agree, all_reduce_partial, broadcast, gather_alarms, root
from rlcheck.errors import ConfigError, MismatchHalt

__all__ = ["all_ranks_agree", "all_reduce_partial", "observe_across_ranks"]


def _verdict(monitor: Monitor | None, step: int, partial: PartialStats, extra: Mapping[str, float] | None,
             trainer_version: int | None = None, alarms: Sequence[Alarm] = (), verdict: Verdict | None = None,
             quarantine_batch: StepBatch | None = None, tally: Tally | None = None,
             correction: CorrectionConfig | None = None,
             floor_sample: float | None = None) -> tuple[tuple, MismatchHalt | Exception | None]:
    """Rank 0: what its Monitor said of the step, as the message every rank receives, and the
    exception it raised (None when the step passed)."""
    if monitor is None:
        error = ConfigError("observe_across_ranks: rank 0 must pass the run's Monitor, it passed None")
        return ("error", *describe(error)), error
    if (verdict is None) != (monitor.cfg.quarantine is None) or correction != monitor.cfg.correction:
        error = ConfigError("observe_across_ranks: pass quarantine=monitor.cfg.quarantine and correction="
                            "monitor.cfg.correction (the same on every rank); the Monitor's quarantine is "
                            f"{monitor.cfg.quarantine}, its correction {monitor.cfg.correction}; the call's quarantine "
                            f"is {'off' if verdict is None else 'on'}, its correction {correction}")
        return ("error", *describe(error)), error
    try:
        return ("ok", monitor.observe_partial(step, partial, None, extra, alarms, trainer_version=trainer_version,
                                              verdict=verdict, quarantine_batch=quarantine_batch, tally=tally,
                                              floor_sample=floor_sample)), None
    except MismatchHalt as halt:
        return ("halt", halt.report, halt.reason, halt.problems), halt
    except Exception as exc:  # every rank must hear of it, or they wait for rank 0 forever
        return ("error", *describe(exc)), exc


def _worst(batch: StepBatch | None, partial: PartialStats) -> StepBatch | None:
    """This rank's worst sequences (its own offenders of the step, host arrays only): what it sends to
    rank 0's dump of a halt, instead of its whole batch."""
    if batch is None or not partial.offenders:
        return None
    worst = batch.select(sorted({o.index for o in partial.offenders}))
    return replace(worst) if worst.device_tensors is not None else worst


def _dump_all(monitor: Monitor | None, step: int, mine: StepBatch | None, report: StepReport,
              reason: str, group: Any = None, failure: str | None = None) -> tuple[str | None, tuple[str, ...]]:
    """Every rank's worst sequences gathered to rank 0, which writes the step's one dump (of those, the
    step's metrics in its meta): (its path, what went wrong), the same on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    parts: list | None = [None] * world if rank == 0 else None
    dist.gather_object((mine, failure), parts, dst=root(group), group=group)
    where, problems = None, ()
    if rank == 0 and monitor is not None and monitor.cfg.halt.dump:
        held = [b for b, _ in parts if b is not None]
        problems = tuple(f"rank {r} sent no sequences to the dump ({f})" for r, (_, f) in enumerate(parts) if f)
        selected = {"how": "the worst sequences of each rank (its offenders by max |d|)",
                    "of_sequences": int(report.metrics.get(K.SEQ_COUNT, 0)), "ranks": world}
        try:
            where = str(monitor.dump(step, StepBatch.concat(held), report, reason=reason,
                                     selected=selected)) if held else None
        except Exception as exc:  # the halt matters more than its evidence
            problems += (f"the dump could not be written ({type(exc).__name__}: {exc})",)
            warnings.warn(f"rlcheck: the dump of step {step} failed ({exc})", RuntimeWarning, stacklevel=3)
    return broadcast((where, problems), group)


def _own_part(report: StepReport, batch: StepBatch | None, own: Verdict | None,
              correction: tuple[CorrectionConfig, Correction] | None = None) -> StepReport:
    """`report` (the step's, from rank 0) with this rank's keep, quarantined sequences, batch and its
    tokens' correction (`report.correction(...)` of the Monitor's settings: not computed again)."""
    if own is not None:
        report.keep, report.quarantined = own.keep, own.quarantined
    else:
        report.keep, report.quarantined = None if batch is None else np.ones(batch.num_sequences, dtype=bool), ()
    report.batch = batch
    report.corrections = {} if correction is None else {correction[0]: _global_norm(correction[1], report)}
    return report


def _global_norm(c: Correction, report: StepReport) -> Correction:
    """`c` (this rank's) with its weights normalized by the whole step's mean weight
    (`rollout_is_batch_normalize`, as verl's distributed mean), not this rank's alone."""
    local = c.metrics.get("rollout_is_batch_norm_factor")
    whole = report.metrics.get(PREFIX + "rollout_is_batch_norm_factor")
    if local is None or whole is None or whole == local:
        return c
    return replace(c, weights=(c.weights * (local / whole)).astype(np.float32))


def observe_across_ranks(monitor: Monitor | None, step: int, batch: StepBatch | None, stats: StatsConfig,
                         extra: Mapping[str, float] | None = None, group: Any = None, *,
                         trainer_version: int | None = None, alarms: Sequence[Alarm] = (),
                         quarantine: QuarantineConfig | None = None, max_weight_lag: int = 0,
                         correction: CorrectionConfig | None = None, floor_sample: float | None = None) -> StepReport:
    """One Monitor step over every rank of `group` (a collective: each rank calls it with its own
    `batch`, a `StepBatch`, or None when it has nothing to compare). `monitor`: rank 0's Monitor
    (the other ranks pass None; theirs is not used); `stats`: the same `StatsConfig` on every rank
    (the Monitor's `cfg.stats`); `extra`: rank 0's scalars for the step; `trainer_version`: rank 0's,
    compared with every rank's sequences' `weight_version`; `alarms`: this rank's, found outside the
    Monitor (its engine's failed sync check), every rank's judged with the step's; `quarantine`,
    `max_weight_lag` and `correction`: the Monitor's `cfg.quarantine`, `cfg.max_weight_lag` and
    `cfg.correction`, the same on every rank (see the module docstring); `floor_sample`: this rank's measure of
    the model's own noise at the engine's precision (`rlcheck.core.floors`; the ranks' mean is the step's). Returns rank 0's `StepReport`
    on every rank, with the rank's own `keep`, `quarantined`, `batch` and correction; raises
    `MismatchHalt` on every rank when rank 0's Monitor halts, after one dump of every rank's worst
    sequences; raises on every rank when rank 0's Monitor, or any rank's own part of the step, fails."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    guard = RankGuard(step, group)
    own = merged = quarantined = None
    alarms = gather_alarms(alarms, group)
    if quarantine is not None:
        signature = monitor.cfg.detectors.signature if rank == 0 and monitor is not None else None
        partial, own, merged, quarantined = judge_across_ranks(batch, stats, quarantine, max_weight_lag,
                                                               trainer_version, alarms, signature, group, guard)
    elif batch is not None:
        partial = guard.call(compute_partial, batch, stats, default=empty_partial(stats))
    else:
        partial = empty_partial(stats)
    keep = None if own is None else own.keep
    found, tally = (None, Tally()) if batch is None else guard.call(batch_tally, batch, keep, correction,
                                                                    default=(None, Tally()))
    shared = guard.exchange((correction, tally, floor_sample))  # a failure on any rank is raised on every rank here
    if any(c != correction for c, _, _ in shared):
        raise ConfigError(f"observe_across_ranks: the ranks pass different corrections ({[c for c, _, _ in shared]}); "
                          "pass correction=monitor.cfg.correction on every rank")
    local = partial
    partial = all_reduce_partial(partial, group, top_k=stats.top_k)
    samples = [f for _, _, f in shared if f is not None]
    sample = sum(samples) / len(samples) if samples else None
    said, raised = (_verdict(monitor, step, partial, extra, trainer_version, alarms, merged, quarantined,
                             Tally.merge(t for _, t, _ in shared), correction, sample) if rank == 0 else (None, None))
    said = broadcast(said, group)
    mine = None if found is None else (correction, found)
    if said[0] == "ok":
        return _own_part(said[1], batch, own, mine)
    if said[0] == "error":
        _, name, message = said
        if raised is not None:
            raise raised
        raise rebuild(name, message, step)
    _, report, reason, problems = said
    worst = guard.call(_worst, batch, local)
    failure = None if guard.failure is None else f"{type(guard.failure).__name__}: {guard.failure}"
    where, more = _dump_all(monitor if rank == 0 else None, step, worst, report, reason, group, failure)
    raise MismatchHalt(_own_part(report, batch, own, mine), reason, where, tuple(problems) + tuple(more)) from raised
