"""The Monitor: one call per training step turns rollout and trainer logprobs into statistics,
alarms, logs and, when the run has gone wrong, a halt with the evidence on disk.

    mon = Monitor(MonitorConfig(run_dir="runs/x"))
    report = mon.observe(step, StepBatch.from_ragged(...))   # may raise MismatchHalt

`observe` validates, computes (`rlcheck.core.stats`), runs every detector, appends the step's record to the
run's journal (metrics.jsonl, through its `Run`), shows it to every sink, saves the detector state atomically
(`state.json`: a new Monitor resumes), then applies the halt policy: on halt it flushes the sinks, writes the
dump, closes the run (lock released), raises `MismatchHalt`. Hard limits alarm (critical) with halting on
or off, a NaN/inf logprob always; halting off skips the halt. A step with no token to compare (all masked,
e.g. TRL's `mask_truncated_completions`, or no sequence on any rank) is logged as empty (`"empty": true`,
counts only) with a warning and skipped by the detectors, never an exception.

One live Monitor per run dir (`Run.create` locks it, released by `close()`, a halt and process death); one
that resumes a run warns naming the step, counts it in state.json and marks its first record (`"resumed"`).
A batch with MoE routing adds the `rlcheck/moe/*` metrics and, when rerouted tokens carry the mismatch, a
warning (`rlcheck.core.moe.routing_alarms`).

Quarantine (`MonitorConfig.quarantine`, `rlcheck.core.quarantine`): the sequences the rules condemn are
taken out before the detectors judge the step (the report's `keep` and `quarantined` say which and why);
their request ids and reasons go into the step's record (`"quarantined"`) and the sequences into
`quarantine/step_N/` (at most `max_dumped` a run); past `max_frac` a critical `quarantine` alarm halts.

Crash safety (`rlcheck.core.run.files` has the fsync rules): each step's metrics.jsonl line is fsynced
before state.json is saved; a new Monitor replays any line a killed process logged after its last state
save (no step lost or logged twice). A full disk raises `RecordWriteError` after the sinks got the step
(on a halting step the halt is raised all the same, naming what could not be written)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core import inputs
from rlcheck.core import metrics as K
from rlcheck.core import quarantine as Q
from rlcheck.core.batch import StepBatch
from rlcheck.core.batch_tally import batch_tally, tally_metrics
from rlcheck.core.catch_up import catch_up
from rlcheck.core.config import DEFAULT_HARD_LIMITS, Floor, HaltConfig, MonitorConfig
from rlcheck.core.detect import Alarm, build_detectors
from rlcheck.core.halting import HaltPolicy
from rlcheck.core.inputs import check_alarms, check_extra, check_step, check_version, is_empty_step
from rlcheck.core.moe import routing_alarms
from rlcheck.core.quarantine_run import Quarantine
from rlcheck.core.run import Run
from rlcheck.core.run.files import STATE_FILE
from rlcheck.core.run.journal import step_record
from rlcheck.core.stats import PartialStats, finalize, levels
from rlcheck.core.tally import Tally
from rlcheck.core.turn_alarms import turn_step
from rlcheck.core.types import StepReport
from rlcheck.core.weights import check_versions
from rlcheck.errors import MismatchHalt, RecordWriteError, RunDirError

__all__ = ["DEFAULT_HARD_LIMITS", "STATE_FILE", "HaltConfig", "Monitor", "MonitorConfig", "StepReport"]

STATE_VERSION = 1


class Monitor:
    """See the module docstring. Not thread-safe; one Monitor per run (on rank 0 when distributed)."""

    def __init__(self, cfg: MonitorConfig, *, wandb_run: Any = None):
        from rlcheck.sinks import make_sinks

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run = Run.create(self.run_dir)
        try:
            self.detectors = build_detectors(cfg.detectors, cfg.context)
            self.floor = Floor.of(cfg, self.detectors)  # the precision's floor, which the gates scale with
            self.last_step: int | None = None
            self.policy = HaltPolicy(cfg.halt)
            self.alarm_counts: dict[str, int] = {}
            self.resumes = 0
            self._noted_identical = False  # bitwise-equal sides are noted once (`rlcheck.core.inputs`)
            self.quarantine = Quarantine(cfg.quarantine, cfg.detectors.signature) if cfg.quarantine else None
            self._resumed: dict[str, Any] | None = None  # goes into the first record this Monitor writes
            self._sink_state: dict[str, Any] = {}
            if self.run.has_state():
                if not cfg.resume:
                    raise RunDirError(f"{self.run_dir} already holds a run (state.json); pass resume=True to "
                                      "continue it, or choose a new run_dir")
                self._load_state()
            self._has_state = self.run.has_state()
            self.sinks = make_sinks(cfg.sinks, self.run_dir, wandb_config=cfg.wandb, wandb_run=wandb_run)
            self.sinks.load_state_dict(self._sink_state)  # a resumed run's W&B totals go on from its own
        except BaseException:
            self.run.close()
            raise

    # ---- public API ----------------------------------------------------------------------------

    def observe(self, step: int, batch: StepBatch, extra: Mapping[str, float] | None = None,
                alarms: Sequence[Alarm] = (), *, trainer_version: int | None = None,
                probe: StepBatch | None = None, floor_sample: float | None = None) -> StepReport:
        """Compare one step's logprobs; log, alarm, and raise `MismatchHalt` if the policy says so.
        `extra`: the caller's own scalars (reward, timings; keys outside `rlcheck/`), logged beside the
        metrics, never seen by the detectors. `alarms`: found outside the Monitor for this step (the
        engine guard's), judged by the halt policy like the detectors' own. `trainer_version`: the
        trainer's weights version, compared with the batch's `weight_version` (`rlcheck.core.weights`).
        `probe`: the sync check's fixed probe batch scored this step, the drift detectors' control. `floor_sample`:
        the trainer's measure of its own noise at the engine's precision (`rlcheck.core.floors`)."""
        t0 = time.perf_counter()
        step, trainer_version = check_step(step), check_version(trainer_version)
        batch = (turned := turn_step(batch, self.cfg.turn_checks, trainer_version, self.cfg.max_weight_lag)).batch
        partial, verdict = Q.step_partial(batch, self.floor.stats(self.cfg.stats), self.cfg.quarantine,
                                          trainer_version, self.cfg.max_weight_lag, check_alarms(alarms, step),
                                          self.cfg.detectors.signature, turned.condemned)
        keep = None if verdict is None else verdict.keep
        own = {**levels.level_spread(batch, self.cfg.stats.clip, keep), **levels.probe_level(probe, self.cfg.stats.clip),
               **turned.metrics()}
        correction, tally = batch_tally(batch, keep, self.cfg.correction)
        report = self._observe(step, partial, batch, t0, extra, [*alarms, *turned.alarms(step, verdict, self.cfg.quarantine)],
                               trainer_version, verdict=verdict, quarantine_batch=batch, own=own, tally=tally, floor_sample=floor_sample)
        if correction is not None:  # the loss's `report.correction(...)` of the same settings: not computed again
            report.corrections[self.cfg.correction] = correction
        return report

    def observe_partial(self, step: int, partial: PartialStats, batch: StepBatch | None = None,
                        extra: Mapping[str, float] | None = None, alarms: Sequence[Alarm] = (), *,
                        trainer_version: int | None = None, verdict: Q.Verdict | None = None,
                        quarantine_batch: StepBatch | None = None, probe: StepBatch | None = None,
                        tally: Tally | None = None, floor_sample: float | None = None) -> StepReport:
        """Like `observe` for statistics already reduced across ranks (`rlcheck.distributed`); `batch` (this
        rank's sequences) goes into the dump on halt when given; `verdict`: the quarantine verdict of every
        rank's sequences (in rank order), `quarantine_batch` its quarantined sequences (for their dump); `tally`:
        the ranks' merged `batch_tally` (correction, MoE; from `batch` when not given). No `seq/level_spread`."""
        if tally is None and batch is not None:
            _, tally = batch_tally(batch, None if verdict is None else verdict.keep, self.cfg.correction)
        return self._observe(check_step(step), partial, batch, time.perf_counter(), extra, alarms,
                             check_version(trainer_version), verdict=verdict, quarantine_batch=quarantine_batch,
                             own=levels.probe_level(probe, self.cfg.stats.clip), tally=tally, floor_sample=floor_sample)

    def dump(self, step: int, batch: StepBatch, report: StepReport | None = None, reason: str = "on demand",
             selected: Mapping[str, Any] | None = None) -> Path:
        """Write the forensic dump of `batch` for `step` now; `selected`: how `batch` was chosen among the
        step's sequences when it is not all of them (meta.json's `selected`)."""
        return self.run.write_dump(
            step, batch, reason=reason, selected=selected,
            metrics=report.metrics if report else None,
            alarms=[a.to_dict() for a in report.alarms] if report else (),
            offenders=[o.to_dict() for o in report.offenders] if report else (),
            context=dict(self.cfg.context), divergence_tau=self.cfg.stats.divergence_tau, redact=self.cfg.redact)

    def close(self) -> None:
        """Close the sinks and the run (its journal, its lock); a second call does nothing more."""
        try:
            self.sinks.close()
        finally:
            self.run.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- one step ------------------------------------------------------------------------------

    def _observe(self, step: int, partial: PartialStats, batch: StepBatch | None, t0: float,
                 extra: Mapping[str, float] | None = None, outside: Sequence[Alarm] = (),
                 trainer_version: int | None = None, verdict: Q.Verdict | None = None,
                 quarantine_batch: StepBatch | None = None, own: Mapping[str, float] | None = None,
                 tally: Tally | None = None, floor_sample: float | None = None) -> StepReport:
        extra = check_extra(extra)
        outside = check_alarms(outside, step)  # before any state changes
        if not self._has_state:  # the fresh state, with the offset the first line will start at
            self._save_state()
            self._has_state = True
        if self.last_step is not None and step <= self.last_step:
            warnings.warn(f"rlcheck: step {step} comes after step {self.last_step}; observing it anyway "
                          "(a resumed trainer repeating steps?)", stacklevel=3)
        metrics, offenders = finalize(partial, self.cfg.stats)
        empty = is_empty_step(metrics)
        if not (self.cfg.true_on_policy or self._noted_identical) and inputs.identical_sides(metrics):
            self._noted_identical = True
            warnings.warn(inputs.IDENTICAL_NOTE.format(count=metrics[K.TOKEN_COUNT], step=step), stacklevel=3)
        metrics.update({} if empty else own or {})  # a whole batch's (`rlcheck.core.stats.levels`)
        self.floor.observe(metrics, empty, floor_sample)  # calibrates (unknown dtypes), takes the sample, logs it
        if empty:
            warnings.warn(f"rlcheck: step {step} has no token to compare ({metrics.get(K.SEQ_COUNT, 0):.0f} "
                          f"sequences, {metrics.get(K.TOKEN_MASKED_COUNT, 0):.0f} tokens masked out): logged as "
                          "an empty step, skipped by the detectors", stacklevel=3)
        # every metric a rule or a hard limit may name, before they judge (`rlcheck.core.metrics.check_names`)
        weights: list[Alarm] = []
        if trainer_version is not None:
            found, weights = check_versions(step, partial.versions, trainer_version, self.cfg.max_weight_lag)
            metrics.update(found)
        quarantined: list[Alarm] = []
        added: dict[str, Any] = {}
        if verdict is not None and self.quarantine is not None:
            quarantined, found, added = self.quarantine.step(
                self.run, step, verdict, quarantine_batch, context=dict(self.cfg.context),
                divergence_tau=self.cfg.stats.divergence_tau, redact=self.cfg.redact)
            metrics.update(found)
        metrics.update(tally_metrics(tally or Tally(), self.cfg.correction))  # rlcheck/corr/*, rlcheck/moe/*
        alarms: list[Alarm] = []
        for det in self.detectors.values() if not empty else ():
            alarms += det.update(step, metrics)
        metrics.update(extra)  # the caller's own scalars: a hard limit may watch them, the detectors do not
        hard = self.policy.hard_limit_alarms(step, metrics) + (inputs.exact_alarms(step, metrics) if self.cfg.true_on_policy else [])
        alarms += outside + weights + hard + quarantined + routing_alarms(step, metrics)
        metrics[K.ALARM_COUNT] = float(len(alarms))
        metrics[K.MONITOR_SECONDS] = time.perf_counter() - t0
        report = StepReport(step, metrics, alarms, offenders, batch=batch)
        if verdict is not None:
            report.keep, report.quarantined = verdict.keep, verdict.quarantined
        elif batch is not None:
            report.keep = np.ones(batch.num_sequences, dtype=bool)
        self.advance(step, alarms, empty)
        self.policy.decide(report, hard)

        write_error = self._record(report, {**step_record(report, partial.hists["ad"], empty, self._resumed), **added})
        if write_error is None:
            self._resumed = None
        if report.halted:
            self._halt(report, batch, write_error)
        if write_error is not None:
            raise write_error
        return report

    def _record(self, report: StepReport, record: dict[str, Any]) -> RecordWriteError | None:
        """Append to the journal, show to every sink, then save the state; an I/O failure of the
        journal or the state comes back as the error to raise (after the sinks got the step)."""
        try:
            try:
                self.run.append(report.step, record)
            finally:
                self.sinks.log(report.step, record)
            self._save_state()
        except OSError as exc:
            self._flush_quietly()
            error = RecordWriteError(report, exc)
            error.__cause__ = exc
            return error
        return None

    def _flush_quietly(self) -> list[str]:
        try:
            self.run.flush()
            self.sinks.flush()
        except Exception as exc:  # the caller is already raising about this run directory
            return [f"flushing the journal or the sinks failed ({exc})"]
        return []

    @property
    def streak(self) -> int:
        """Steps in a row with a halting alarm (`HaltPolicy`)."""
        return self.policy.streak

    def advance(self, step: int, alarms: list[Alarm], empty: bool = False) -> None:
        """Bookkeeping of one observed step: the halting streak, the last step, alarm counts."""
        self.policy.advance(alarms, empty)
        self.last_step = step
        for a in alarms:
            self.alarm_counts[a.kind] = self.alarm_counts.get(a.kind, 0) + 1

    def _halt(self, report: StepReport, batch: StepBatch | None, write_error: RecordWriteError | None) -> None:
        """Flush, dump, raise `MismatchHalt`: raised even when a write failed, naming what is missing."""
        problems = [f"the step's record was not written ({write_error.__cause__})"] if write_error else []
        cause: BaseException | None = write_error
        problems += self._flush_quietly()
        where = None
        if self.cfg.halt.dump and batch is not None:
            try:
                where = str(self.dump(report.step, batch, report, reason=report.halt_reason))
            except Exception as exc:
                problems.append(f"the dump could not be written ({type(exc).__name__}: {exc})")
                cause = exc
        try:  # a halted run is over: sinks closed, lock released (a notebook may build a new Monitor)
            self.close()
        except Exception as exc:  # noqa: BLE001 - named in the halt
            problems.append(f"closing the run failed ({exc})")
        raise MismatchHalt(report, report.halt_reason, where, tuple(problems)) from cause

    # ---- run directory and state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "last_step": self.last_step,
            "streak": self.streak,
            "alarm_counts": self.alarm_counts,
            "resumes": self.resumes, "floor": self.floor.state_dict(),
            **({"quarantine": self.quarantine.state_dict()} if self.quarantine is not None else {}),
            "detectors": {kind: det.state_dict() for kind, det in self.detectors.items()},
            "sinks": self.sinks.state_dict(),
        }

    def _save_state(self) -> None:
        self.run.save_state(self.state_dict())  # with what this state has seen of metrics.jsonl

    def _load_state(self) -> None:
        state = self.run.read_state()
        if state.get("version") != STATE_VERSION:
            raise RunDirError(f"{self.run_dir / STATE_FILE} has state version {state.get('version')}, this rlcheck reads {STATE_VERSION}")
        self.last_step = state.get("last_step")
        self.policy.streak = int(state.get("streak", 0))
        self.alarm_counts = {k: int(v) for k, v in state.get("alarm_counts", {}).items()}
        self.resumes = int(state.get("resumes", 0)) + 1
        self._sink_state = state.get("sinks") or {}
        if self.quarantine is not None:
            self.quarantine.load_state_dict(state.get("quarantine") or {})
        self.floor.load_state_dict(state.get("floor") or {})
        for kind, det_state in state.get("detectors", {}).items():
            if kind in self.detectors:
                self.detectors[kind].load_state_dict(det_state)
        caught_up = catch_up(self, state.get("jsonl_bytes"))
        self._resumed = {"after_step": self.last_step, "count": self.resumes}
        after = "before any step" if self.last_step is None else f"after step {self.last_step}"
        warnings.warn(f"rlcheck: resuming {self.run_dir} (resume {self.resumes} of this run){caught_up}; "
                      f"the detectors resume {after}", stacklevel=4)
