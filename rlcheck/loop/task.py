"""A verifiable toy task for GRPO: add two numbers, rewarded by a program.

Prompts are "12+7=" (bos-prefixed token ids of the model's own tokenizer, digits are single tokens).
The reward reads the first integer of the decoded response: 1.0 when it is the sum; otherwise shaped
partial credit, `0.5 * exp(-|guess - answer| / (answer + 1))` for a wrong integer, plus up to 0.2 for
answering in digits (the share of digits among the response's first 8 characters). The shaping makes
the samples of one prompt differ in reward even under a random model: GRPO learns from differences
within a group, and a group of equal rewards has zero advantage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

_FIRST_INT = re.compile(r"\d+")
FORMAT_CHARS = 8


@dataclass(frozen=True)
class AdditionTask:
    max_operand: int = 99
    num_prompts: int = 8
    """Prompts per step (each sampled G times)."""
    seed: int = 0
    multi_turn: ClassVar[bool] = False
    """One engine call per rollout (`rlcheck.loop.agent.CalculatorTask` takes several)."""

    def prompts(self, step: int) -> list[tuple[str, int]]:
        """(text, answer) pairs of one step; the same step always draws the same ones."""
        rng = np.random.default_rng([self.seed, step])
        a = rng.integers(0, self.max_operand + 1, self.num_prompts)
        b = rng.integers(0, self.max_operand + 1, self.num_prompts)
        return [(f"{x}+{y}=", int(x + y)) for x, y in zip(a, b, strict=True)]

    def rewards(self, rollouts: Sequence[Any], items: Sequence[tuple[str, int]]) -> np.ndarray:
        """(len(rollouts),) each rollout's `reward` against its prompt's answer."""
        return np.array([reward(r.text, items[r.prompt_index][1]) for r in rollouts])


def reward(response_text: str, answer: int) -> float:
    """1.0 for the right sum, else shaped partial credit (module docstring); in [0, 1]."""
    head = response_text.strip()[:FORMAT_CHARS]
    digits = 0.2 * sum(c.isdigit() for c in head) / FORMAT_CHARS
    m = _FIRST_INT.search(response_text)
    if m is None:
        return digits
    guess = int(m.group()[:12])
    if guess == answer:
        return 1.0
    return digits + 0.5 * math.exp(-abs(guess - answer) / (answer + 1))


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, beginning with the tokenizer's bos token when it has one."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer.encode(t, add_special_tokens=False) for t in texts]
