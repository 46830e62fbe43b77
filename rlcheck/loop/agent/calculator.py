"""A multi-turn task for the loop: sum three numbers with an `add` tool, one pair per call.

    task = CalculatorTask(num_prompts=8, seed=0)
    items = task.prompts(step)                 # [(prompt text, answer)], the text in the chat format
    env = task.environment(question, answer)   # one per trajectory
    reply = env.step(turn_text)                # the tool's reply, or None: the turn answered

The model (`runs/models/<arch>-calculator`, `rlcheck.modelzoo.build_trained(task="calculator")`)
writes `<think>12+7</think>add(a=12, b=7)`; the environment runs the call and replies with the
sum ("19"), as a user turn of the chat template; a turn without a call is the answer. The reward is
the addition task's (`rlcheck.loop.task.reward`) on the answer (after its thought), 0 for a
trajectory that ran out of turns; every call that parses adds `CALL_CREDIT`, up to the calls the
problem needs, so that GRPO has a difference to learn from while the answers are all right or all wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from rlcheck.errors import ConfigError
from rlcheck.loop.agent.dialogue import MAX_OPERAND, NUM_OPERANDS, THINK_CLOSE, TOOL_NAME
from rlcheck.loop.task import reward

CALL = re.compile(rf"{TOOL_NAME}\(\s*a\s*=\s*(-?\d+)\s*,\s*b\s*=\s*(-?\d+)\s*\)")
CALL_CREDIT = 0.1
TURN_TOKENS = 40
"""Tokens a model turn may take (a thought, a call and eos: ~25-32 in canonical tokens)."""
MAX_RESULT = 10**9
"""The tool refuses larger operands (a sampled run of digits is not a number to add)."""


@dataclass(frozen=True)
class CalculatorTask:
    num_operands: int = NUM_OPERANDS
    max_operand: int = MAX_OPERAND
    num_prompts: int = 8
    """Prompts per step (each sampled G times)."""
    seed: int = 0
    max_turns: int = 3
    """Model turns a trajectory may take (the problem needs `num_operands`); each turn generates at
    most the rollout engine's `max_tokens` (`TURN_TOKENS` in the calculator preset)."""
    multi_turn: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.num_operands < 2 or self.max_operand < 1 or self.num_prompts < 1:
            raise ConfigError("a calculator task needs num_operands >= 2, max_operand >= 1 and num_prompts >= 1")
        if self.max_turns < 2:
            raise ConfigError(f"a calculator task needs max_turns >= 2, got {self.max_turns}")

    def prompts(self, step: int) -> list[tuple[str, int]]:
        """(prompt text, answer) pairs of one step, the same for the same step: the user turn and the
        assistant header of the chat template (the loop's bos in front makes it the template's render)."""
        rng = np.random.default_rng([self.seed, step, 7])
        numbers = rng.integers(0, self.max_operand + 1, (self.num_prompts, self.num_operands))
        return [(f"<|user|>\n{'+'.join(str(int(x)) for x in row)}<|eos|>\n<|assistant|>\n", int(row.sum()))
                for row in numbers]

    def environment(self, answer: int) -> CalculatorEnv:
        return CalculatorEnv(answer, self.num_operands - 1)

    def rewards(self, rollouts: Sequence[Any], items: Sequence[tuple[str, int]]) -> np.ndarray:
        """(len(rollouts),) each episode's reward, as its environment gave it (`CalculatorEnv.reward`)."""
        return np.array([r.reward for r in rollouts])


@dataclass
class CalculatorEnv:
    """One trajectory's tool: `step(text)` runs the call a model turn makes, or takes its answer."""

    answer: int
    calls_needed: int
    calls: int = 0
    answered: str | None = None
    """The answer turn's text after its thought; None while the trajectory goes on (or never answered)."""
    replies: list[str] = field(default_factory=list)

    def step(self, text: str) -> str | None:
        """The tool's reply to a model turn's text; None when the turn holds no call (its answer)."""
        m = CALL.search(text)
        if m is None:
            self.answered = text.split(THINK_CLOSE, 1)[-1]
            return None
        self.calls += 1
        a, b = int(m.group(1)), int(m.group(2))
        reply = str(a + b) if max(abs(a), abs(b)) <= MAX_RESULT else "error: number too large"
        self.replies.append(reply)
        return reply

    def reward(self) -> float:
        """The answer's reward plus the credit of the calls (module docstring), in [0, 1 + CALL_CREDIT * calls_needed]."""
        credit = CALL_CREDIT * min(self.calls, self.calls_needed)
        if self.answered is None:
            return credit
        return reward(self.answered, self.answer) + credit
