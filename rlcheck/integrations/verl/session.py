"""rlcheck's state inside one verl trainer, on verl's driver (`rlcheck.integrations.verl.plugin`): its
settings, its Monitor (made at the first observed step, where verl's own resume is known), and the
metrics that go into verl's logger.

The run directory follows verl's resume: a trainer whose first step is 1 started fresh, so an earlier
run found in `run_dir` is kept aside as `<run_dir>.prev-N` and a new run starts; a trainer whose first
step is past 1 resumed from its checkpoint (`trainer.resume_mode`), and rlcheck resumes the run in
`run_dir` with it (the detectors keep their history; a step observed again after a halt is logged
again, with a warning). The first step that alarms without halting is dumped (as rlcheck's own loop
does), so that `rlcheck diagnose` reads its sequences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.config import HaltConfig, MonitorConfig
from rlcheck.core.monitor import Monitor
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.types import StepReport
from rlcheck.integrations import verl as rlcheck_verl
from rlcheck.integrations.rundir import set_aside
from rlcheck.integrations.verl.fully_async import LAGGED_FRAC, MAX_LAG, STALE_COUNT
from rlcheck.integrations.verl.settings import VerlSettings
from rlcheck.loop.trainer_view import keep_first_alarm

OWN_KEYS = (LAGGED_FRAC, MAX_LAG, STALE_COUNT)
"""Keys outside `rlcheck/` that are rlcheck's own (the fully async trainer's lag), logged to verl too."""


class Session:
    """One verl trainer's rlcheck: `observe` each step, `verl_metrics` for verl's logger, `close` at the end."""

    def __init__(self, settings: VerlSettings, kind: str, context: Mapping[str, Any], precision: Any = None):
        self.settings, self.kind, self.context = settings, kind, dict(context)
        self.precision = precision
        """The two sides' dtypes from verl's config (`rlcheck.core.floors.Precision`): the run's floor."""
        self.monitor: Monitor | None = None
        self.pending: dict[str, float] = {}
        """The last observed step's metrics, not yet in verl's logger (legacy and fully async trainers)."""

    def _start(self, first_step: int) -> Monitor:
        s = self.settings
        if first_step <= 1:
            set_aside(s.run_dir, "this verl run (it starts at step 1)", "verl's resume from a checkpoint, "
                      "trainer.resume_mode=auto or resume_path,")
        return Monitor(MonitorConfig(
            run_dir=s.run_dir, sinks=s.sinks, halt=HaltConfig(enabled=s.halt), max_weight_lag=s.max_weight_lag,
            quarantine=QuarantineConfig() if s.quarantine else None, correction=s.correction,
            resume=first_step > 1, precision=self.precision,
            context={"framework": "verl", "trainer": self.kind, **self.context}))

    def observe(self, step: int, data: Any, metrics: Mapping[str, Any] | None = None, **kwargs) -> StepReport:
        """`rlcheck_verl.observe` on this run's Monitor, with its correction handed back to `data`; the
        report's own metrics are kept for verl's logger (`pending`)."""
        if self.monitor is None:
            self.monitor = self._start(step)
        report = rlcheck_verl.observe(self.monitor, step, data, metrics, correction=self.settings.correction,
                                      **kwargs)
        keep_first_alarm(self.monitor, report, report.batch)  # a step that alarms without halting keeps its evidence
        self.pending = verl_metrics(report)
        return report

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def verl_metrics(report: StepReport) -> dict[str, float]:
    """The report's own finite numbers (rlcheck/..., the fully async lag), for verl's logger."""
    out = {}
    for key, value in report.metrics.items():
        if (key.startswith(K.PREFIX) or key in OWN_KEYS) and isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out
