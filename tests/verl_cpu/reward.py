"""The reward of verl's runs here (`reward.custom_reward_function.path`): the addition task's
(`rlcheck.loop.task.reward`), partial credit so that the samples of one prompt differ and GRPO learns; for
the calculator (multi-turn) rows, the answer after the last thought, plus the calculator task's credit
per call (`rlcheck.loop.agent.calculator`)."""

from __future__ import annotations

from rlcheck.loop.agent.calculator import CALL, CALL_CREDIT
from rlcheck.loop.agent.dialogue import NUM_OPERANDS, THINK_CLOSE
from rlcheck.loop.task import reward

CALCULATOR_SOURCE = "rlcheck/calculator"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    if data_source == CALCULATOR_SOURCE:
        calls = len(CALL.findall(solution_str))
        return reward(solution_str.split(THINK_CLOSE)[-1], int(ground_truth)) + CALL_CREDIT * min(calls, NUM_OPERANDS - 1)
    return reward(solution_str, int(ground_truth))
