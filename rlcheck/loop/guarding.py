"""The engine guard in the loop: the rollout engine runs with `VLLMConfig.guard`, its files go to the
run directory, and each step's violations become Monitor alarms (kind "signature", signature
"engine_guard", critical: they halt the step they happen in, with the evidence in the alarm and the
guard's record copied into the dump). A guard that died (its reader or checker raised) is an alarm
too, at the step it is first seen (signature "engine_guard_dead", warn, the exception in its details),
and `guard/alive` is 0 from then on."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlcheck.core.types import Alarm
from rlcheck.engines.guard.alarms import ALIVE_METRIC, SKIPPED_METRIC
from rlcheck.engines.vllm import VLLMConfig


def with_run_dir(rollout: VLLMConfig, run_dir: str) -> VLLMConfig:
    """`rollout` with its guard writing under `run_dir/guard/` unless the caller chose a directory."""
    if rollout.guard is None or rollout.guard.run_dir is not None:
        return rollout
    return dataclasses.replace(rollout, guard=dataclasses.replace(rollout.guard, run_dir=str(run_dir)))


def step_alarms(engine: Any, step: int) -> tuple[list[Alarm], dict[str, float]]:
    """The guard's alarms of `step` and its scalars, asked of the rollout actor (through the
    `RolloutSupervisor` `engine`): `guard/violations` this step, `guard/alive` (0 once it died: a dead
    guard never logs like a clean one) and `guard/skipped_steps` (engine steps it could not trace)."""
    from rlcheck.engines.guard import GUARD_METRIC, guard_alarms

    report = engine.call(lambda actor: actor.guard_report.remote())
    return guard_alarms(step, report), {GUARD_METRIC: float(len(report["violations"])),
                                        ALIVE_METRIC: float(report["alive"]),
                                        SKIPPED_METRIC: float(report["skipped_steps"])}


def into_dump(engine: Any, dump_dir: str | None) -> None:
    """Copy the guard's record into a halt's dump (best effort: the dump is already whole)."""
    if dump_dir:
        try:
            engine.call(lambda actor: actor.write_guard.remote(dump_dir))
        except Exception as exc:  # the engine may be gone; the run dir's guard/ still has the record
            import warnings

            warnings.warn(f"rlcheck: the guard record was not copied into {dump_dir}: {exc}", stacklevel=2)
