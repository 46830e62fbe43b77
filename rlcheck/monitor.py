"""The Monitor: one call per training step turns rollout and trainer logprobs into statistics,
alarms, logs and, when the run has gone wrong, a halt with the evidence on disk.

    mon = Monitor(MonitorConfig(run_dir="runs/x"))
    report = mon.observe(step, StepBatch.from_ragged(...))   # may raise MismatchHalt

`observe` validates, computes (`rlcheck.stats`), runs every detector, logs to every sink, saves the
detector state atomically (`state.json`, so a new Monitor on the same run dir resumes), then applies
the halt policy: on halt it flushes the sinks, writes the step's dump and raises `MismatchHalt`.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck import metrics as K
from rlcheck.batch import StepBatch
from rlcheck.detect import KINDS, SEVERITIES, Alarm, DetectorsConfig, build_detectors, severity_rank
from rlcheck.dump import dump_dir, write_dump
from rlcheck.errors import InputError, MismatchHalt, RunDirError
from rlcheck.stats import Offender, PartialStats, StatsConfig, compute_partial, finalize

STATE_FILE = "state.json"
STATE_VERSION = 1

DEFAULT_HARD_LIMITS = {
    K.NONFINITE_COUNT: 0.0,  # any NaN/inf logprob
    K.MULT_PROB_ERROR: 2.0,  # mean exp|d|: probabilities off by 2x on average
    K.ABS_DIFF_MEAN: 1.0,  # mean |d| of one nat
    K.SEQ_CATASTROPHIC_FRAC: 0.25,  # a quarter of the sequences far off
}


@dataclass(frozen=True)
class HaltConfig:
    """When the Monitor stops the run (README, "Halting", states these defaults)."""

    enabled: bool = True
    kinds: tuple[str, ...] = KINDS
    """Alarm kinds that may halt."""
    min_severity: str = "critical"
    """Alarms below this severity never halt."""
    patience: int = 1
    """Consecutive steps with a halting alarm before the run halts."""
    hard_limits: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_HARD_LIMITS))
    """metric -> limit: exceeding one halts at once (a critical threshold alarm, patience ignored)."""
    dump: bool = True
    """Write the step's forensic dump before raising."""

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown alarm kinds {sorted(unknown)}; known: {KINDS}")
        if self.min_severity not in SEVERITIES:
            raise ValueError(f"min_severity must be one of {SEVERITIES}, got {self.min_severity!r}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        bad = {k: v for k, v in self.hard_limits.items() if not isinstance(v, (int, float)) or math.isnan(v)}
        if bad:
            raise ValueError(f"hard limits must be numbers, got {bad}")


@dataclass(frozen=True)
class MonitorConfig:
    run_dir: str | os.PathLike
    """Where metrics.jsonl, state.json, dumps/ and wandb/ go; created if missing."""
    sinks: tuple[Any, ...] = ("jsonl", "console")
    """Any of "jsonl", "console", "wandb", or your own `rlcheck.sinks.Sink` instances. JSONL is what
    summarize, diagnose and report read."""
    stats: StatsConfig = field(default_factory=StatsConfig)
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    halt: HaltConfig = field(default_factory=HaltConfig)
    wandb: Any = None
    """A `rlcheck.sinks.WandbConfig` for the "wandb" sink (defaults when None)."""
    resume: bool = True
    """Load state.json from run_dir when it exists, so the detectors keep their history; when False,
    a run_dir that already holds a run is refused (nothing is overwritten)."""
    redact: bool = False
    """Leave prompt and response token ids out of dumps."""
    context: Mapping[str, Any] = field(default_factory=dict)
    """Model, engine and sampling settings, written into every dump's meta.json."""

    def __post_init__(self) -> None:
        if not str(self.run_dir):
            raise ValueError("run_dir must be a directory path")
        if isinstance(self.sinks, str):
            raise ValueError(f"sinks is a tuple of names, e.g. ({self.sinks!r},)")


@dataclass
class StepReport:
    """What one `observe` call found."""

    step: int
    metrics: dict[str, float]
    alarms: list[Alarm]
    offenders: tuple[Offender, ...]
    halted: bool = False
    halt_reason: str = ""


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InputError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def _check_extra(extra: Mapping[str, float] | None) -> dict[str, float]:
    if not extra:
        return {}
    out = {}
    for key, value in extra.items():
        if not isinstance(key, str) or not key or key.startswith(K.PREFIX):
            raise InputError(f"extra metric name {key!r}: use a non-empty name outside {K.PREFIX!r}")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise InputError(f"extra metric {key!r} must be a number, got {type(value).__name__}") from None
    return out


def _atomic_write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    data = json.dumps(obj, allow_nan=False).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Monitor:
    """See the module docstring. Not thread-safe; one Monitor per run (on rank 0 when distributed)."""

    def __init__(self, cfg: MonitorConfig, *, wandb_run: Any = None):
        from rlcheck.sinks import make_sinks

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self._prepare_run_dir()
        self.detectors = build_detectors(cfg.detectors)
        self.last_step: int | None = None
        self.streak = 0
        self.alarm_counts: dict[str, int] = {}
        if (self.run_dir / STATE_FILE).exists():
            if not cfg.resume:
                raise RunDirError(
                    f"{self.run_dir} already holds a run (state.json); pass resume=True to continue it, "
                    "or choose a new run_dir"
                )
            self._load_state()
        self.sinks = make_sinks(cfg.sinks, self.run_dir, wandb_config=cfg.wandb, wandb_run=wandb_run)

    # ---- public API ----------------------------------------------------------------------------

    def observe(self, step: int, batch: StepBatch, extra: Mapping[str, float] | None = None) -> StepReport:
        """Compare one step's logprobs; log, alarm, and raise `MismatchHalt` if the policy says so.
        `extra`: the caller's own scalars for this step (reward, timings; keys outside `rlcheck/`),
        logged beside the metrics to every sink, never seen by the detectors."""
        if not isinstance(batch, StepBatch):
            raise InputError(
                f"observe takes a StepBatch, got {type(batch).__name__}; build one with "
                "StepBatch.from_ragged, from_padded or from_packed"
            )
        t0 = time.perf_counter()
        return self._observe(_check_step(step), compute_partial(batch, self.cfg.stats), batch, t0, extra)

    def observe_partial(self, step: int, partial: PartialStats, batch: StepBatch | None = None,
                        extra: Mapping[str, float] | None = None) -> StepReport:
        """Like `observe` for statistics already reduced across ranks (`rlcheck.distributed`);
        `batch` (this rank's sequences) goes into the dump on halt when given."""
        return self._observe(_check_step(step), partial, batch, time.perf_counter(), extra)

    def dump(self, step: int, batch: StepBatch, report: StepReport | None = None, reason: str = "on demand") -> Path:
        """Write the forensic dump of `batch` for `step` now."""
        return write_dump(
            dump_dir(self.run_dir, step), batch, step=step, reason=reason,
            metrics=report.metrics if report else None,
            alarms=[a.to_dict() for a in report.alarms] if report else (),
            offenders=[o.to_dict() for o in report.offenders] if report else (),
            context=dict(self.cfg.context), divergence_tau=self.cfg.stats.divergence_tau, redact=self.cfg.redact,
        )

    def close(self) -> None:
        self.sinks.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- one step ------------------------------------------------------------------------------

    def _observe(self, step: int, partial: PartialStats, batch: StepBatch | None, t0: float,
                 extra: Mapping[str, float] | None = None) -> StepReport:
        extra = _check_extra(extra)
        if self.last_step is not None and step <= self.last_step:
            warnings.warn(
                f"rlcheck: step {step} comes after step {self.last_step}; observing it anyway "
                "(a resumed trainer repeating steps?)",
                stacklevel=3,
            )
        metrics, offenders = finalize(partial, self.cfg.stats)
        alarms: list[Alarm] = []
        for det in self.detectors.values():
            alarms += det.update(step, metrics)
        hard = self._hard_limit_alarms(step, metrics)
        alarms += hard
        metrics[K.ALARM_COUNT] = float(len(alarms))
        metrics.update(extra)
        metrics[K.MONITOR_SECONDS] = time.perf_counter() - t0
        report = StepReport(step, metrics, alarms, offenders)
        self._decide_halt(report, hard)
        self.last_step = step
        for a in alarms:
            self.alarm_counts[a.kind] = self.alarm_counts.get(a.kind, 0) + 1

        hist = partial.hists["ad"]
        bins = np.flatnonzero(hist)
        self.sinks.log(step, {
            "step": step,
            "time": time.time(),
            "metrics": metrics,
            "alarms": [a.to_dict() for a in alarms],
            "offenders": [o.to_dict() for o in offenders],
            "abs_diff_hist": {"bins": bins.tolist(), "counts": hist[bins].tolist()},
        })
        self._save_state()
        if report.halted:
            self._halt(report, batch)
        return report

    def _hard_limit_alarms(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        if not self.cfg.halt.enabled:
            return []
        out = []
        for key, limit in self.cfg.halt.hard_limits.items():
            value = metrics.get(key)
            if value is not None and value > limit:
                out.append(Alarm(
                    "threshold", key, step, "critical",
                    f"{key} = {value:.4g} is past the hard limit {limit:g}",
                    {"value": value, "limit": limit, "hard_limit": True},
                ))
        return out

    def _decide_halt(self, report: StepReport, hard: list[Alarm]) -> None:
        h = self.cfg.halt
        if not h.enabled:
            return
        qualifying = [
            a for a in report.alarms
            if a.kind in h.kinds and severity_rank(a.severity) >= severity_rank(h.min_severity)
        ]
        self.streak = self.streak + 1 if qualifying else 0
        if hard:
            report.halted, report.halt_reason = True, hard[0].message
        elif qualifying and self.streak >= h.patience:
            report.halted = True
            report.halt_reason = f"{qualifying[0].kind} alarm on {qualifying[0].metric}: {qualifying[0].message}"

    def _halt(self, report: StepReport, batch: StepBatch | None) -> None:
        self.sinks.flush()
        where = None
        if self.cfg.halt.dump and batch is not None:
            where = str(self.dump(report.step, batch, report, reason=report.halt_reason))
        raise MismatchHalt(report, report.halt_reason, where)

    # ---- run directory and state ---------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".rlcheck-write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise RunDirError(f"run directory {self.run_dir} is not writable: {exc}") from None

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "last_step": self.last_step,
            "streak": self.streak,
            "alarm_counts": self.alarm_counts,
            "detectors": {kind: det.state_dict() for kind, det in self.detectors.items()},
        }

    def _save_state(self) -> None:
        _atomic_write_json(self.run_dir / STATE_FILE, self.state_dict())

    def _load_state(self) -> None:
        path = self.run_dir / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RunDirError(
                f"{path} cannot be read ({exc}); move it away to start fresh, or pass resume=False"
            ) from None
        if state.get("version") != STATE_VERSION:
            raise RunDirError(f"{path} has state version {state.get('version')}, this rlcheck reads {STATE_VERSION}")
        self.last_step = state.get("last_step")
        self.streak = int(state.get("streak", 0))
        self.alarm_counts = {k: int(v) for k, v in state.get("alarm_counts", {}).items()}
        for kind, det_state in state.get("detectors", {}).items():
            if kind in self.detectors:
                self.detectors[kind].load_state_dict(det_state)
