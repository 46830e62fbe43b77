"""The GRPO loop with the monitor in it: rollout -> recompute -> observe -> update -> weight sync.

    with ray_session():
        result = run_grpo(LoopConfig(rollout=VLLMConfig(...), trainer=TrainerConfig(...)), monitor)

Per step: the rollout actor samples G responses for each prompt of the toy task (vLLM, weights of
version v); the trainer group recomputes their logprobs under the training weights (also version v,
unless a sync was missed); `monitor.observe` compares the two (and may raise `MismatchHalt`); the
rewards become group-normalised advantages and the group takes one clipped-surrogate step; the
gathered weights go to vLLM as version v + 1. A halt stops the actors and returns with the evidence
(the Monitor wrote the dump before raising). `loop.jsonl` in the run directory gets one line per
step: rewards, loss, and the time of each phase.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.engines.vllm import VLLMConfig, to_step_batch
from rlcheck.errors import ConfigError, MismatchHalt
from rlcheck.faults import Fault
from rlcheck.loop.placement import Placement
from rlcheck.loop.task import AdditionTask, encode_prompts, reward
from rlcheck.monitor import Monitor, StepReport
from rlcheck.trainers import Sequences, TrainerConfig, group_advantages

PHASES = ("generate", "recompute", "monitor", "update", "sync")


@dataclass(frozen=True)
class LoopConfig:
    rollout: VLLMConfig
    trainer: TrainerConfig
    world_size: int = 2
    """Trainer ranks (FSDP2 / DeepSpeed data-parallel degree); 1 for the hf backend."""
    steps: int = 20
    group_size: int = 4
    """G: samples per prompt."""
    task: AdditionTask = field(default_factory=AdditionTask)
    placement: Placement = field(default_factory=Placement)
    fault: Fault = field(default_factory=Fault)

    def context(self) -> dict[str, Any]:
        """What a dump should record of this run (`MonitorConfig.context`): model, engine, sampling."""
        r, t = self.rollout, self.trainer
        return {
            "model": r.model,
            "engine": {"name": "vllm", "engine_id": r.engine_id, "dtype": r.dtype, "logprobs_mode": r.logprobs_mode,
                       "kv_cache_bytes": r.kv_cache_bytes, "max_num_seqs": r.max_num_seqs},
            "sampling": {"temperature": r.temperature, "max_tokens": r.max_tokens, "n": self.group_size,
                         **r.sampling},
            "trainer": {"backend": t.backend, "zero_stage": t.zero_stage if t.backend == "deepspeed" else None,
                        "world_size": self.world_size, "dtype": t.dtype, "lr": t.lr},
            "fault": self.fault.describe(),
        }

    def __post_init__(self) -> None:
        if self.steps < 1 or self.group_size < 2 or self.world_size < 1:
            raise ConfigError("need steps >= 1, group_size >= 2 (GRPO compares samples) and world_size >= 1")
        if self.rollout.temperature != self.trainer.temperature:
            raise ConfigError(
                f"rollout temperature {self.rollout.temperature} != trainer temperature "
                f"{self.trainer.temperature}: the logprobs would differ by construction"
            )
        if os.path.abspath(self.rollout.model) != os.path.abspath(self.trainer.model):
            raise ConfigError(f"rollout model {self.rollout.model} and trainer model {self.trainer.model} differ")


@dataclass
class LoopResult:
    steps_run: int = 0
    halted: bool = False
    reason: str | None = None
    dump_dir: str | None = None
    reports: list[StepReport] = field(default_factory=list)
    timings: list[dict[str, float]] = field(default_factory=list)
    """Seconds per phase (`PHASES`) and `total`, one dict per step."""
    rewards: list[float] = field(default_factory=list)
    """Mean reward per step."""


StepCallback = Callable[[int, StepReport, dict[str, Any]], None]


class GRPOLoop:
    """The actors of one run and its steps; `run()` drives them, `close()` stops them."""

    def __init__(self, cfg: LoopConfig, monitor: Monitor):
        from transformers import AutoTokenizer

        from rlcheck.loop.group import TrainerGroup, start_rollout

        self.cfg, self.monitor = cfg, monitor
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.rollout.model)
        self.log_path = Path(monitor.run_dir) / "loop.jsonl"
        self.rollout = start_rollout(cfg.rollout, cfg.placement, cfg.fault.engine_fault())
        try:
            self.group = TrainerGroup(cfg.fault.trainer_config(cfg.trainer), cfg.world_size, cfg.placement)
        except BaseException:
            self._kill_rollout()
            raise
        self.version = 0  # the trainer's weights; vLLM holds `self.synced`
        self.synced = 0
        self.fault_touched: list[str] = []

    def run(self, on_step: StepCallback | None = None, start: int = 0) -> LoopResult:
        result = LoopResult()
        for step in range(start, start + self.cfg.steps):
            try:
                report, info = self.step(step)
            except MismatchHalt as halt:
                result.halted, result.reason, result.dump_dir = True, halt.reason, halt.dump_dir
                self._log({"step": step, "halted": True, "reason": halt.reason, "dump": halt.dump_dir,
                           "fault_touched": self.fault_touched}, halt.report)
                result.reports.append(halt.report)
                result.steps_run += 1
                if on_step:
                    on_step(step, halt.report, {"halted": True})
                break
            result.reports.append(report)
            result.timings.append(info["seconds"])
            result.rewards.append(info["reward_mean"])
            result.steps_run += 1
            if on_step:
                on_step(step, report, info)
        return result

    def step(self, step: int) -> tuple[StepReport, dict[str, Any]]:
        import ray

        cfg, t = self.cfg, _Timer()
        items = cfg.task.prompts(step)
        prompts = encode_prompts(self.tokenizer, [text for text, _ in items])
        with t("generate"):
            rollouts = ray.get(self.rollout.generate.remote(prompts, step, cfg.group_size))
        seqs = Sequences.build([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts])
        plan = self.group.plan(seqs)
        with t("recompute"):
            logp_train = self.group.logprobs(seqs, plan)
        rewards = np.array([reward(r.text, items[r.prompt_index][1]) for r in rollouts])
        extra = {
            "loop/reward_mean": float(rewards.mean()),
            "loop/response_tokens_mean": seqs.num_response_tokens / len(seqs),
            "loop/weights_behind": float(self.version - self.synced),
        }
        batch, faulted = cfg.fault.apply(step, to_step_batch(rollouts, logp_train, tokens_train=seqs.responses))
        if self.version > self.synced:  # a left-out sync: every rollout of the step is stale
            faulted = list(batch.request_ids)
        self.fault_touched = faulted  # ground truth for self-tests; the monitor never sees it
        with t("monitor"):
            report = self.monitor.observe(step, batch, extra=extra)
        with t("update"):
            adv = group_advantages(rewards, cfg.group_size)
            train = self.group.train_step(seqs.with_update_inputs(adv, logp_train), plan)
            self.version += 1
        skipped = cfg.fault.skip_sync(step)
        with t("sync"):
            if not skipped:
                ray.get(self.rollout.sync_weights.remote(self.group.full_state_dict_ref(), self.version))
                self.synced = self.version
        info = {"step": step, "reward_mean": extra["loop/reward_mean"], "train": train,
                "sync_skipped": skipped, "fault_touched": faulted, "seconds": t.seconds}
        self._log(info, report)
        return report, info

    def _log(self, info: dict[str, Any], report: StepReport) -> None:
        line = dict(info, alarms=len(report.alarms))
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        """Stop the trainer ranks (process groups destroyed) and the rollout engine."""
        self.group.shutdown()
        self._kill_rollout()

    def _kill_rollout(self) -> None:
        import ray

        try:
            ray.get(self.rollout.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - already dead: killing is enough
            pass
        ray.kill(self.rollout)


def run_grpo(cfg: LoopConfig, monitor: Monitor, on_step: StepCallback | None = None) -> LoopResult:
    """Start the actors, run `cfg.steps` steps (or until the monitor halts), stop the actors."""
    loop = GRPOLoop(cfg, monitor)
    try:
        return loop.run(on_step)
    finally:
        loop.close()


class _Timer:
    """`with t("phase"):` records the phase's seconds, and `total` since the timer began."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = time.perf_counter() - t
            self.seconds["total"] = time.perf_counter() - self._t0
