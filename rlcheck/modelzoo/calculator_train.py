"""Training rows and the evaluation of the calculator model (`TrainSpec(task="calculator")`): whole
dialogues (`rlcheck.modelzoo.calculator.Dialogues`), one per row; greedy episodes against the loop's
environment (`rlcheck.loop.agent.calculator`), each next prompt the previous prompt + the turn's ids +
the tool's suffix ids, as the loop builds them."""

from __future__ import annotations

from typing import Any

import numpy as np

EVAL_EPISODES = 64


class CalculatorRows:
    """Training rows: one calculator dialogue from each row's start, padding masked (-100)."""

    def __init__(self, tok: Any, spec: Any):
        from rlcheck.modelzoo.calculator import Dialogues

        self.spec, self.pad = spec, tok.pad_token_id
        self.rng = np.random.default_rng([spec.seed, 20_241])
        self.dialogues = Dialogues(tok, max_operand=spec.max_operand)

    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels), each (batch_rows, row_tokens) int64."""
        rows, width = self.spec.batch_rows, self.spec.row_tokens
        ids = np.full((rows, width), self.pad, dtype=np.int64)
        labels = np.full((rows, width), -100, dtype=np.int64)
        for r in range(rows):
            line = self.dialogues.ids(self.rng)[:width]
            ids[r, : len(line)] = line
            labels[r, : len(line)] = line
        return ids, labels


def evaluate(model: Any, tok: Any, max_operand: int, episodes: int = EVAL_EPISODES) -> tuple[float, float]:
    """Greedy success rate (the right answer) and mean reward of `episodes` problems of
    `CalculatorTask(seed=12345)`."""
    import torch

    from rlcheck.loop.agent.calculator import TURN_TOKENS, CalculatorTask
    from rlcheck.modelzoo.calculator import tool_suffix_ids

    task = CalculatorTask(max_operand=max_operand, num_prompts=episodes, seed=12345)
    rewards, right = [], 0
    with torch.no_grad():
        for text, answer in task.prompts(0):
            env = task.environment(answer)
            ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
            for _ in range(task.max_turns):
                out = _greedy(model, ids, TURN_TOKENS, tok.eos_token_id)
                reply = env.step(tok.decode(out, skip_special_tokens=True))
                if reply is None:
                    break
                ids = ids + out + tool_suffix_ids(tok, reply)
            rewards.append(env.reward())
            right += env.answered is not None and env.answered.strip() == str(answer)
    return right / episodes, float(np.mean(rewards))


def _greedy(model: Any, ids: list[int], max_new: int, eos: int) -> list[int]:
    import torch

    x = torch.tensor([ids])  # (1, T)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(model(input_ids=x).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
        x = torch.cat([x, torch.tensor([[nxt]])], 1)
    return out
