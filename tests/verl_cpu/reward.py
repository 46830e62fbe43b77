"""The reward of verl's runs here (`reward.custom_reward_function.path`): the addition task's
(`rlcheck.loop.task.reward`), partial credit so that the samples of one prompt differ and GRPO learns."""

from __future__ import annotations

from rlcheck.loop.task import reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return reward(solution_str, int(ground_truth))
