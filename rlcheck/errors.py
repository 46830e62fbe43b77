"""Errors rlcheck raises. Anything a caller can cause is an `RLCheckError` with a message that says
what was wrong and how to fix it; `MismatchHalt` is the deliberate stop of a run gone wrong."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from rlcheck.monitor import StepReport


class RLCheckError(Exception):
    """Base class of every error rlcheck raises on purpose."""


class InputError(RLCheckError, ValueError):
    """The data handed to rlcheck is malformed (shapes, dtypes, values, identities)."""


class ConfigError(RLCheckError, ValueError):
    """A configuration value is out of range or inconsistent."""


class RunDirError(RLCheckError, OSError):
    """The run directory cannot be created, written or read."""


class MismatchHalt(RLCheckError):
    """Raised by `Monitor.observe` after the halt policy fired; the sinks are flushed and the step's
    dump and the monitor state are on disk before it is raised.

    Attributes:
        report: the `StepReport` of the step that halted.
        reason: one line naming the alarm or limit that halted the run.
        dump_dir: where the step's forensic dump was written.
    """

    def __init__(self, report: StepReport, reason: str, dump_dir: str | None = None):
        self.report = report
        self.reason = reason
        self.dump_dir = dump_dir
        where = f"; evidence in {dump_dir}" if dump_dir else ""
        super().__init__(f"rlcheck halted the run at step {report.step}: {reason}{where}")
