"""What one GRPO run is asked for and what it gives back: `LoopConfig` (the rollout engine and trainer
configs, world size, steps, group size, task, placement, fault, the lost-actor bounds and timeouts),
the sync check, validated in `__post_init__`, and `LoopResult` (steps run, the halt and its reason, the dump, the
last reports, phase timings and rewards, engine restarts), with the phase names `PHASES` and the
per-step callback type. The loop that runs them is `rlcheck.loop.driver`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.sync_check import SyncCheckConfig
from rlcheck.core.types import StepReport
from rlcheck.engines.vllm import VLLMConfig
from rlcheck.errors import ActorDiedError, ConfigError
from rlcheck.faults import Fault
from rlcheck.loop.agent.calculator import CalculatorTask
from rlcheck.loop.agent.wiring import check_task
from rlcheck.loop.audit import DecodePrefillAudit
from rlcheck.loop.group import DEFAULT_CALL_TIMEOUT_S, DEFAULT_COLLECTIVE_TIMEOUT_S
from rlcheck.loop.placement import Placement
from rlcheck.loop.recovery import EngineRestart
from rlcheck.loop.task import AdditionTask
from rlcheck.loop.weight_sync import WeightSyncConfig
from rlcheck.trainers import TrainerConfig

PHASES = ("generate", "recompute", "monitor", "update", "sync", "sync_check")


@dataclass(frozen=True)
class LoopConfig:
    rollout: VLLMConfig
    trainer: TrainerConfig
    world_size: int = 2
    """Trainer ranks (FSDP2 / DeepSpeed data-parallel degree); 1 for the hf backend."""
    steps: int = 20
    group_size: int = 4
    """G: samples per prompt."""
    task: AdditionTask | CalculatorTask = field(default_factory=AdditionTask)
    """The single-turn addition task, or the multi-turn calculator (`rlcheck.loop.agent`: a tool call per
    turn, the tool's reply appended to the engine's own ids)."""
    placement: Placement = field(default_factory=Placement)
    fault: Fault = field(default_factory=Fault)
    max_engine_restarts: int = 2
    """Times a lost rollout engine is replaced by a fresh one (with the trainer's weights) before the
    run stops; 0: the first loss stops it."""
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    """An actor call (generate, a trainer phase, a weight sync, an engine start) unanswered after this
    long counts as a lost actor."""
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    """The trainer process group's timeout: a rank waiting this long in a collective raises."""
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)
    """After a sync, check that the engine holds the trainer's weights (`rlcheck.core.sync_check`):
    fingerprints every sync, the probe batch every 10 (their cost: BENCHMARKS.md, "Sync check");
    a failed check is a critical `weights` alarm at the next step. `SyncCheckConfig(0, 0)`: off."""
    correction: CorrectionConfig | None = None
    """The importance-sampling correction in the loss (verl's `rollout_correction` names: e.g.
    `CorrectionConfig(rollout_is="token")`, token TIS capped at 2): each response token's clipped
    surrogate is weighted by `StepReport.correction`'s weight, the rejected tokens dropped. The
    sequences the Monitor quarantines (`MonitorConfig.quarantine`) leave the loss either way; None:
    no IS weight."""
    audit: DecodePrefillAudit | None = None
    """Re-score a sample of each step's rollouts with a fresh prefill of the rollout engine and compare
    with their decode logprobs (`rlcheck.loop.audit`): a rollout past the threshold is an alarm of the
    step (critical by default), from the engine alone, before the trainer recomputes. Needs rollouts
    sampled at temperature 1 without logit processing. None: off."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the weights reach the engine after each update (`rlcheck.loop.weight_sync`): Ray's object
    store (the default), or `WeightSyncConfig("collective", bucket_mb=512)`: rank 0 broadcasts them to
    the engine over a gloo group of their own, in buckets (BENCHMARKS.md, "Weight sync scaling")."""
    measure_floor: bool = True
    """With an engine in a coarser dtype than the trainer's (a bf16 engine, a fp32 trainer): every step the
    trainer scores the step's tokens once more at the engine's dtype (`rlcheck.trainers.precision`), and the Monitor
    judges the step at that measured noise where it is above the precision's level
    (`rlcheck.loop.floor_sample`; one more forward a step). False: the precision's level only."""
    keep_reports: int = 10_000
    """Most recent steps whose reports, timings and rewards `LoopResult` holds in memory (a long run
    would otherwise grow by a few kB a step); metrics.jsonl and loop.jsonl have every step."""

    def context(self) -> dict[str, Any]:
        """What a dump should record of this run (`MonitorConfig.context`): model, the engine's sampling
        and settings as the fault leaves them (`rlcheck.core.run.context`; the loop adds the dtype the
        engine runs once it started: `record_context`), the trainer, and the static preflight's findings."""
        from rlcheck.engines.vllm_env import vllm_record
        from rlcheck.loop.preflight_wiring import loop_findings

        t = self.trainer
        return {
            **self.model_context(),
            **vllm_record(self.fault.rollout_config(self.rollout), n=self.group_size),
            "trainer": {"backend": t.backend, "zero_stage": t.zero_stage if t.backend == "deepspeed" else None,
                        "world_size": self.world_size, "dtype": t.dtype, "lr": t.lr},
            "fault": self.fault.describe(),
            "task": {"name": type(self.task).__name__, "multi_turn": self.task.multi_turn},
            "correction": None if self.correction is None else dataclasses.asdict(self.correction),
            "preflight": loop_findings(self),  # the static preflight's findings (rlcheck.loop.preflight_wiring)
        }

    def model_context(self) -> dict[str, Any]:
        """The context's model entries: its path, HF `model_type` and routed experts (`rlcheck.core.model_types`)."""
        from rlcheck.core.model_types import experts_at, model_type_at

        model = self.rollout.model
        return {"model": model, "model_type": model_type_at(model), "experts": experts_at(model), "framework": "loop"}

    def __post_init__(self) -> None:
        if self.steps < 1 or self.group_size < 2 or self.world_size < 1:
            raise ConfigError("need steps >= 1, group_size >= 2 (GRPO compares samples) and world_size >= 1")
        if self.max_engine_restarts < 0 or min(self.call_timeout_s, self.collective_timeout_s) <= 0:
            raise ConfigError("need max_engine_restarts >= 0, call_timeout_s > 0 and collective_timeout_s > 0")
        if self.correction is not None and not isinstance(self.correction, CorrectionConfig):
            raise ConfigError(f"correction must be a CorrectionConfig or None, got {type(self.correction).__name__}")
        if self.audit is not None:
            from rlcheck.loop.audit import check_sampling

            if not isinstance(self.audit, DecodePrefillAudit):
                raise ConfigError(f"audit must be a rlcheck.loop.audit.DecodePrefillAudit or None, got "
                                  f"{type(self.audit).__name__}")
            check_sampling(self.rollout)
        if not isinstance(self.weight_sync, WeightSyncConfig):
            raise ConfigError(f"weight_sync must be a rlcheck.loop.weight_sync.WeightSyncConfig, got {self.weight_sync!r}")
        if self.weight_sync.method == "collective":
            from rlcheck.engines.vllm_worker_sync import check_backend

            check_backend(self.weight_sync.group_backend(self.trainer.device), self.rollout.tensor_parallel_size)
        if self.keep_reports < 1:
            raise ConfigError(f"keep_reports must be >= 1, got {self.keep_reports}")
        if self.rollout.temperature != self.trainer.temperature:
            raise ConfigError(
                f"rollout temperature {self.rollout.temperature} != trainer temperature "
                f"{self.trainer.temperature}: the logprobs would differ by construction"
            )
        if os.path.abspath(self.rollout.model) != os.path.abspath(self.trainer.model):
            raise ConfigError(f"rollout model {self.rollout.model} and trainer model {self.trainer.model} differ")
        check_task(self)  # a multi-turn task's refusals (rlcheck.loop.agent.wiring)


@dataclass
class LoopResult:
    steps_run: int = 0
    """Steps run in all; `reports`, `timings` and `rewards` hold the last `LoopConfig.keep_reports`."""
    halted: bool = False
    reason: str | None = None
    dump_dir: str | None = None
    reports: list[StepReport] = field(default_factory=list)
    """One per step, the halting step's included."""
    timings: list[dict[str, float]] = field(default_factory=list)
    """Seconds per phase (`PHASES`) and `total`, one dict per step."""
    rewards: list[float] = field(default_factory=list)
    """Mean reward per step."""
    restarts: list[EngineRestart] = field(default_factory=list)
    """Every replacement of the rollout engine."""
    error: ActorDiedError | None = None
    """Set when a lost actor stopped the run (`halted` is True, `reason` is its message)."""

    def keep(self, report: StepReport, info: dict[str, Any], limit: int) -> None:
        """Count a finished step and keep its report, timings and reward (the last `limit` of each)."""
        self.steps_run += 1
        for kept, item in ((self.reports, report), (self.timings, info["seconds"]), (self.rewards, info["reward_mean"])):
            kept.append(item)
            if len(kept) > limit:
                del kept[0]


StepCallback = Callable[[int, StepReport, dict[str, Any]], None]


def record_context(monitor: Any, cfg: LoopConfig, engine: Any) -> None:
    """Make every dump of the run record how its rollout engine samples and runs, over whatever the
    caller's `MonitorConfig.context` said of it: the sampling and settings as the fault leaves them,
    and the dtype the engine runs, asked of the rollout actor (`engine`: its `RolloutSupervisor`); the
    same in the run's context.json, for a run that never dumps (its preflight's findings, for diagnose)."""
    from rlcheck.engines.vllm_env import vllm_record

    settings = engine.call(lambda actor: actor.effective_settings.remote())
    own = vllm_record(cfg.fault.rollout_config(cfg.rollout), n=cfg.group_size, settings=settings)
    context = {**cfg.model_context(), **monitor.cfg.context, **own}
    monitor.cfg = dataclasses.replace(monitor.cfg, context=context)
    monitor.run.write_context(context)  # context.json: what diagnose reads of a run that never dumps
