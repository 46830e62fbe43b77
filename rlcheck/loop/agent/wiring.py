"""The multi-turn task in the loop's step (`rlcheck.loop.driver`): its episodes, with the weight sync a
`stale-turn` fault moves between two turns, and the trainer's view of them (the single-turn task's
rollouts and view otherwise); and what `LoopConfig` refuses with a multi-turn task (or a multi-turn
fault without one). `apply_in_loop`: a fault's batch-level `apply`, left out for a multi-turn fault,
whose episodes went wrong themselves."""

from __future__ import annotations

from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault
from rlcheck.faults.turn_plan import TurnPlan, apply_in_loop, turn_plan
from rlcheck.faults.turns import TurnFault


def plan_of(fault: Any, step: int) -> TurnPlan:
    """The fault's plan for this step's episodes (`rlcheck.faults.turn_plan`); the healthy one for another."""
    return turn_plan(fault, step)


def rollouts_of(loop: Any, items, prompts: list[list[int]], step: int) -> list:
    """The step's rollouts: one engine call (`group_size` per prompt), or a multi-turn task's episodes."""
    return run_episodes(loop, items, prompts, step) if loop.cfg.task.multi_turn else loop._generate(prompts, step)


def run_episodes(loop: Any, items, prompts: list[list[int]], step: int) -> list:
    """The step's episodes on the loop's engine; before the turn the fault's plan names, the weight
    sync the last update left out (and its check)."""
    from rlcheck.loop.agent.episodes import EpisodeRunner

    cfg = loop.cfg
    plan = plan_of(cfg.fault, step)

    def before_turn(turn: int) -> None:
        if plan.sync_before_turn == turn and loop.version > loop.synced:
            loop._sync(step)
            loop._check_sync(step)

    runner = EpisodeRunner(cfg.task, loop.tokenizer, lambda p, n, seeds: loop._generate(p, step, n, seeds),
                           cfg.rollout.seed)
    return runner.run(items, prompts, step, cfg.group_size, plan, before_turn)


def view_of(loop: Any, step: int, seqs: Any, rollouts: list):
    """What the trainer scores: the engine's ids or a fault's (`rlcheck.loop.trainer_view`); a multi-turn
    task's episodes turn by turn (`rlcheck.loop.agent.view`)."""
    if not loop.cfg.task.multi_turn:
        from rlcheck.loop.trainer_view import trainer_view

        return trainer_view(loop.cfg.fault, step, seqs, rollouts, loop.tokenizer)
    from rlcheck.loop.agent.view import episode_view

    return episode_view(rollouts, plan_of(loop.cfg.fault, step), loop.tokenizer)


def check_task(cfg: Any) -> None:
    """ConfigError for what a multi-turn task cannot run with, and a multi-turn fault without one."""
    task, fault = cfg.task, cfg.fault
    if not task.multi_turn:
        if isinstance(fault, TurnFault):
            raise ConfigError(f"{fault.name} is a fault of multi-turn episodes: run it with a multi-turn task "
                              "(rlcheck demo --task calculator, LoopConfig(task=CalculatorTask()))")
        return
    if cfg.rollout.top_logprobs:
        raise ConfigError("a multi-turn task does not record top-k logprobs: run it without --topk "
                          "(VLLMConfig.top_logprobs=0)")
    if cfg.audit is not None:
        raise ConfigError("the decode-prefill audit re-scores single-turn rollouts: run a multi-turn task without it")
    if type(fault).trainer_inputs is not Fault.trainer_inputs:
        raise ConfigError(f"{fault.name} changes what the trainer scores of a single-turn rollout; the multi-turn "
                          "faults of that kind are retokenized-history, stripped-history and missing-generation-prompt")


__all__ = ["apply_in_loop", "check_task", "plan_of", "rollouts_of", "run_episodes", "view_of"]
