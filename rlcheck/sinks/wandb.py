"""Weights & Biases output. `wandb` is imported only when a `WandbSink` is built.

Per step, one `run.log(..., step=step)` row holds the scalar metrics, `rlcheck/alarm/count`, the
|d| histogram (`rlcheck/token/abs_diff_hist`) and, every `table_every` steps, the offenders as a
`wandb.Table` (`rlcheck/offenders`). Each alarm also becomes a `run.alert` (ERROR/WARN/INFO for
critical/warn/info). The run summary keeps the totals: alarms by kind, the worst step by mean |d|,
and the last alarm message (keys `rlcheck/summary/*`).

With `run=None` the sink starts its own run (`wandb.init(dir=run_dir, ...)`, so offline runs land in
`run_dir/wandb/`) and finishes it on `close()`; a run passed in is the caller's and is left open. The
run's id is kept in `run_dir/wandb/rlcheck-run-id`: a Monitor resuming the run directory resumes the
same W&B run (`resume="allow"`; offline, `wandb sync` joins its parts), and the summary's totals
(alarms by kind, the worst step) continue from the Monitor's state.json (`state_dict`), not from 0.

A `log()` that raises is tried again (`WandbConfig.log_retries`, waiting `retry_wait_s` doubled each
time); past that the step's row is skipped with one SinkWarning for the whole run, and each later step
is tried once until W&B takes rows again (the summary's `skipped_steps` counts those it missed):
metrics.jsonl holds every step either way. One transient failure used to drop the sink for good.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core import histogram as H
from rlcheck.core import metrics as K
from rlcheck.core.types import Offender
from rlcheck.errors import ConfigError
from rlcheck.sinks.base import Sink, SinkInitError, SinkWarning

MODES = ("online", "offline", "disabled", "shared")
OFFENDERS_KEY = "rlcheck/offenders"
HIST_KEY = "rlcheck/token/abs_diff_hist"
SUMMARY_PREFIX = "rlcheck/summary/"
SUMMARY_WORST_STEP = SUMMARY_PREFIX + "worst_step"
SUMMARY_WORST_ABS_DIFF_MEAN = SUMMARY_PREFIX + "worst_abs_diff_mean"
SUMMARY_ALARMS_TOTAL = SUMMARY_PREFIX + "alarms_total"
SUMMARY_LAST_ALARM = SUMMARY_PREFIX + "last_alarm"
SUMMARY_SKIPPED = SUMMARY_PREFIX + "skipped_steps"
RUN_ID_FILE = "rlcheck-run-id"
"""Under run_dir/wandb: the id of the W&B run the sink started, resumed by the next sink of the run dir."""


def summary_alarms(kind: str) -> str:
    """Run-summary key of the number of alarms of one kind."""
    return f"{SUMMARY_PREFIX}alarms/{kind}"

OFFENDER_COLUMNS = tuple(f.name for f in dataclasses.fields(Offender))
MAX_HIST_BINS = 512  # wandb.Histogram's limit
# Right edge of every |d| bin: the next bin's left edge; the open last bin gets 2x its left edge.
_ABS_RIGHT_EDGES = np.append(H.ABS_EDGES[1:], 2.0 * H.ABS_EDGES[-1])


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Where and how the W&B sink logs."""

    project: str = "rlcheck"
    """W&B project of a run the sink starts."""
    entity: str | None = None
    """W&B entity (user or team); None: the account's default."""
    name: str | None = None
    """Display name of the run; None: W&B picks one."""
    mode: str | None = None
    """"online", "offline", "disabled" or "shared"; None: wandb's own default (env WANDB_MODE)."""
    tags: tuple[str, ...] = ()
    """Tags of a run the sink starts."""
    table_every: int = 1
    """Log the offenders table every this many steps (it is the heaviest item)."""
    alerts: bool = True
    """Send each alarm as a W&B alert (`run.alert`)."""
    log_retries: int = 3
    """Tries after a failed `log()` of a step before its row is skipped (see the module docstring)."""
    retry_wait_s: float = 0.5
    """Wait before the first retry, doubled before each next one."""

    def __post_init__(self) -> None:
        if not isinstance(self.project, str) or not self.project:
            raise ConfigError(f"project must be a non-empty string, got {self.project!r}")
        for name in ("entity", "name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be None or a non-empty string, got {value!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ConfigError(f"mode must be None or one of {MODES}, got {self.mode!r}")
        if isinstance(self.tags, str) or not all(isinstance(t, str) for t in self.tags):
            raise ConfigError(f"tags must be a sequence of strings, got {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))
        if not isinstance(self.table_every, int) or self.table_every < 1:
            raise ConfigError(f"table_every must be an integer >= 1, got {self.table_every!r}")
        if not isinstance(self.log_retries, int) or self.log_retries < 0:
            raise ConfigError(f"log_retries must be an integer >= 0, got {self.log_retries!r}")
        if not (isinstance(self.retry_wait_s, (int, float)) and 0 <= self.retry_wait_s < math.inf):
            raise ConfigError(f"retry_wait_s must be a number of seconds >= 0, got {self.retry_wait_s!r}")


def histogram_args(hist: dict[str, Any] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(counts, edges) for `wandb.Histogram(np_histogram=...)` from the record's sparse |d|
    histogram: the contiguous span of bins from the first to the last nonzero one, merged in
    groups of 2 (or more) if it is longer than wandb allows. None when nothing was counted."""
    if not hist or not hist.get("bins"):
        return None
    bins = np.asarray(hist["bins"], dtype=np.int64)
    counts = np.asarray(hist["counts"], dtype=np.int64)
    if counts.sum() == 0:
        return None
    lo, hi = int(bins.min()), int(bins.max())
    span = hi - lo + 1
    group = -(-span // MAX_HIST_BINS)
    num = -(-span // group)
    dense = np.bincount((bins - lo) // group, weights=counts, minlength=num).astype(np.int64)  # (num,)
    left = lo + np.arange(num) * group
    right_bin = np.minimum(left + group - 1, hi)
    edges = np.append(H.ABS_EDGES[left], _ABS_RIGHT_EDGES[right_bin[-1]])  # (num + 1,)
    return dense, edges


class WandbSink(Sink):
    """Logs each step to a W&B run: the user's `run`, or one it starts from `cfg`."""

    def __init__(self, run_dir: str | os.PathLike[str], cfg: WandbConfig | None = None, run: Any = None):
        self.cfg = cfg or WandbConfig()
        try:
            import wandb
        except ImportError as e:
            raise SinkInitError("the W&B sink needs wandb: pip install 'rlcheck[wandb]'") from e
        self._wandb = wandb
        self._owns_run = run is None
        self.run = run if run is not None else _start_run(wandb, Path(run_dir), self.cfg)
        self._alerts = self.cfg.alerts
        self._alarms_by_kind: Counter[str] = Counter()
        self._worst: tuple[int, float] | None = None  # (step, abs_diff_mean)
        self._closed = False
        self._failing = False  # the last step's row could not be sent
        self._skipped = 0

    def log(self, step: int, record: dict[str, Any]) -> None:
        alarms = record.get("alarms") or []
        row = {k: v for k, v in (record.get("metrics") or {}).items() if isinstance(v, (int, float))}
        row.setdefault(K.ALARM_COUNT, len(alarms))
        offenders = record.get("offenders") or []
        if offenders and step % self.cfg.table_every == 0:
            row[OFFENDERS_KEY] = self._wandb.Table(
                columns=list(OFFENDER_COLUMNS), data=[[o.get(c) for c in OFFENDER_COLUMNS] for o in offenders]
            )
        hist = histogram_args(record.get("abs_diff_hist"))
        if hist is not None:
            row[HIST_KEY] = self._wandb.Histogram(np_histogram=hist)
        if not self._send(step, lambda: self.run.log(row, step=step)):
            return
        if self._alerts:
            self._send_alerts(alarms)
        self._update_summary(step, row.get(K.ABS_DIFF_MEAN), alarms)

    def state_dict(self) -> dict[str, Any]:
        """The summary's totals so far (kept in the Monitor's state.json, so a resumed run continues them)."""
        return {"alarms_by_kind": dict(self._alarms_by_kind), "worst": self._worst, "skipped": self._skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._alarms_by_kind = Counter({str(k): int(v) for k, v in (state.get("alarms_by_kind") or {}).items()})
        worst = state.get("worst")
        self._worst = None if not worst else (int(worst[0]), float(worst[1]))
        self._skipped = int(state.get("skipped", 0))

    def _send(self, step: int, call: Any) -> bool:
        """`call()` (a W&B API call for `step`), tried again on an exception (`WandbConfig.log_retries`,
        once while W&B keeps failing); False when it never went through (one warning for the run)."""
        tries = 1 if self._failing else self.cfg.log_retries + 1
        for attempt in range(tries):
            try:
                call()
                self._failing = False
                return True
            except Exception as exc:  # noqa: BLE001 - W&B's errors have no common base worth naming
                error = exc
                if attempt + 1 < tries:
                    time.sleep(self.cfg.retry_wait_s * 2**attempt)
        if not self._failing and not self._skipped:
            warnings.warn(f"rlcheck: W&B did not take step {step}'s row after {tries} tries ({type(error).__name__}: "
                          f"{error}); steps it does not take are skipped (counted in {SUMMARY_SKIPPED}), "
                          "metrics.jsonl holds every step", SinkWarning, stacklevel=3)
        self._failing = True
        self._skipped += 1
        return False

    def close(self) -> None:
        if self._skipped:  # the steps W&B missed, said in the summary once more at the end
            self._send(-1, lambda: self.run.summary.update({SUMMARY_SKIPPED: self._skipped}))
        if self._owns_run and not self._closed:
            self._closed = True
            self.run.finish()

    def _send_alerts(self, alarms: list[dict[str, Any]]) -> None:
        levels = {
            "critical": self._wandb.AlertLevel.ERROR,
            "warn": self._wandb.AlertLevel.WARN,
            "info": self._wandb.AlertLevel.INFO,
        }
        for a in alarms:
            try:
                self.run.alert(
                    title=f"rlcheck {a.get('severity')}: {a.get('kind')} on {a.get('metric')}",
                    text=f"step {a.get('step')}: {a.get('message')}",
                    level=levels.get(a.get("severity"), self._wandb.AlertLevel.INFO),
                )
            except Exception as e:  # e.g. a mode without alert support: the summary still has them
                self._alerts = False
                warnings.warn(
                    f"rlcheck: W&B alerts are not available ({type(e).__name__}: {e}); alarms stay in "
                    f"'{K.ALARM_COUNT}' and the run summary",
                    SinkWarning,
                    stacklevel=2,
                )
                return

    def _update_summary(self, step: int, abs_diff_mean: Any, alarms: list[dict[str, Any]]) -> None:
        update: dict[str, Any] = {}
        if isinstance(abs_diff_mean, (int, float)) and math.isfinite(abs_diff_mean):
            if self._worst is None or abs_diff_mean > self._worst[1]:
                self._worst = (step, float(abs_diff_mean))
                update[SUMMARY_WORST_STEP] = step
                update[SUMMARY_WORST_ABS_DIFF_MEAN] = float(abs_diff_mean)
        if alarms:
            self._alarms_by_kind.update(str(a.get("kind")) for a in alarms)
            update.update({summary_alarms(k): n for k, n in self._alarms_by_kind.items()})
            update[SUMMARY_ALARMS_TOTAL] = sum(self._alarms_by_kind.values())
            last = alarms[-1]
            update[SUMMARY_LAST_ALARM] = f"step {last.get('step', step)}: {last.get('message')}"
        if self._skipped:
            update[SUMMARY_SKIPPED] = self._skipped
        if update:
            self._send(step, lambda: self.run.summary.update(update))


def _start_run(wandb: Any, run_dir: Path, cfg: WandbConfig) -> Any:
    """The run dir's W&B run under `run_dir/wandb/`: the one its id file names, resumed, else a new one
    (its id then written there); any failure becomes a SinkInitError."""
    id_file = run_dir / "wandb" / RUN_ID_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        run = wandb.init(
            dir=str(run_dir),
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            mode=cfg.mode,
            tags=list(cfg.tags),
            id=run_id or None,
            resume="allow" if run_id else None,
            reinit="create_new",  # never finish a run the user already has open
        )
        if run_id is None and getattr(run, "id", None) and not getattr(run, "disabled", False):
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(str(run.id))
        return run
    except Exception as e:
        raise SinkInitError(
            f"wandb.init failed ({type(e).__name__}: {e}); log in (`wandb login`), or use "
            "WandbConfig(mode='offline'), or leave 'wandb' out of the sinks"
        ) from e
