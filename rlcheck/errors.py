"""Errors rlcheck raises. Anything a caller can cause is an `RLCheckError` with a message that says
what was wrong and how to fix it; `MismatchHalt` is the deliberate stop of a run gone wrong."""

from __future__ import annotations

from typing import Any


class RLCheckError(Exception):
    """Base class of every error rlcheck raises on purpose."""


class InputError(RLCheckError, ValueError):
    """The data handed to rlcheck is malformed (shapes, dtypes, values, identities)."""


class ConfigError(RLCheckError, ValueError):
    """A configuration value is out of range or inconsistent."""


class ClusterResourcesError(ConfigError):
    """The Ray cluster cannot hold the loop's actors (`rlcheck.loop.Placement`): fewer CPUs, GPUs or
    custom resources than the trainer ranks and the rollout engine ask for, in total or on any one
    node, or the ranks' placement group still unplaced after `Placement.schedule_timeout_s`. The
    message names what was asked and what the cluster has."""


class UnsupportedVLLMError(ConfigError):
    """The installed vLLM (or the engine's setup) is not one rlcheck's engine faults know how to hook."""


class SinkInitError(RLCheckError):
    """A sink could not be constructed (e.g. `wandb.init` failed); the original error is the cause."""


class RunDirError(RLCheckError, OSError):
    """The run directory cannot be created, written or read."""


class RecordWriteError(RunDirError):
    """`Monitor.observe` could not record a step (metrics.jsonl or state.json failed mid-run, e.g. a
    full disk). Raised after the sinks got the step and were flushed; the step's `StepReport`
    rides on the error, so nothing computed is lost. The file is left holding whole lines only, and
    state.json the last step that was recorded; the Monitor's detectors in memory have seen the step.

    Attributes:
        report: the `StepReport` (`rlcheck.core.types`) of the step that could not be recorded.
    """

    def __init__(self, report: Any, cause: BaseException):
        self.report = report
        super().__init__(
            f"rlcheck could not record step {report.step}: {cause}. The other sinks received it and its "
            "report is on this error (.report); free space or fix the run directory, then observe the "
            "next step (a new Monitor on the same run_dir resumes from the last recorded step)"
        )


class MismatchHalt(RLCheckError):
    """Raised by `Monitor.observe` after the halt policy fired; the sinks are flushed and the step's
    dump and the monitor state are on disk before it is raised.

    Attributes:
        report: the `StepReport` (`rlcheck.core.types`) of the step that halted.
        reason: one line naming the alarm or limit that halted the run.
        dump_dir: where the step's forensic dump was written (None: no dump, see `problems`).
        problems: what could not be written (the step's record, the dump), one line each; the halt
            is raised all the same, the cause chained.
    """

    def __init__(self, report: Any, reason: str, dump_dir: str | None = None,
                 problems: tuple[str, ...] = ()):
        self.report = report
        self.reason = reason
        self.dump_dir = dump_dir
        self.problems = tuple(problems)
        where = f"; evidence in {dump_dir}" if dump_dir else ""
        trouble = "".join(f"; {p}" for p in self.problems)
        super().__init__(f"rlcheck halted the run at step {report.step}: {reason}{where}{trouble}")

    def __reduce__(self):  # pickled whole (a Ray actor's halt reaches its caller: verl's TaskRunner)
        return (type(self), (self.report, self.reason, self.dump_dir, self.problems))


class ActorDiedError(RLCheckError, RuntimeError):
    """A Ray actor of the loop (`rlcheck.loop`) died or stopped answering and the run cannot go on: a
    trainer rank (its optimizer state died with it), or the rollout engine once
    `LoopConfig.max_engine_restarts` fresh engines were used up or a restart failed. The loop has
    stopped every actor by the time this is reported (on `LoopResult.error`).

    Attributes:
        actor: which actor, e.g. "rollout rollout0" or "trainer rank 1/2".
        step: the step it was lost in; phase: the loop phase then (`rlcheck.loop.PHASES`).
    """

    def __init__(self, actor: str, step: int, phase: str, detail: str):
        self.actor, self.step, self.phase = actor, step, phase
        super().__init__(f"the {actor} actor was lost during {phase} at step {step}: {detail}")


class WeightSyncError(RLCheckError, RuntimeError):
    """A collective weight sync failed: a peer did not join the group, or left it, within the timeout
    (`rlcheck.engines.vllm_collective`)."""


class PathError(InputError):
    """A path given to rlcheck (a run directory, a dump, a model folder, an output) is missing, of the
    wrong kind (a file where a directory is expected), not writable, or one rlcheck refuses to write
    into (a non-empty directory that holds something else, a model folder)."""


class GuardViolation(RLCheckError):
    """The engine guard (`rlcheck.engines.guard`) found a broken lifecycle invariant under its "raise"
    policy; raised at the step, before that step's forward pass. Close the engine afterwards.

    Attributes:
        violations: the step's violations to raise (`rlcheck.engines.guard.Violation`), first named below.
        report: every one of them, one line each (request, step, slot).
        evidence: where the guard wrote its record (run_dir/guard), or None.
    """

    def __init__(self, violations: tuple | list, evidence: str | None = None):
        self.violations = tuple(violations)
        self.report = "\n".join(v.message for v in self.violations)
        self.evidence = evidence
        first = self.violations[0]
        more = f" (+{len(self.violations) - 1} more in this step)" if len(self.violations) > 1 else ""
        where = f"; evidence in {evidence}" if evidence else ""
        super().__init__(f"rlcheck engine guard: invariant {first.invariant} {first.check} broken: "
                         f"{first.message}{more}{where}")
