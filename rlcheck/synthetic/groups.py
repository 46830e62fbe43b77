"""GRPO-shaped steps with the token and prompt ids: each prompt's samples share their first tokens, so
the step holds twins (`rlcheck.core.stats.twins`), and a stale recurrent state can be laid on chosen
sequences. For tests of the twin statistic and of diagnose's engine-state rule.

    batch = grpo_batch(stale={1, 9})   # sequences 1 and 9 start off by 0.3 nats: a stale state
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from rlcheck.core.batch import StepBatch


def grpo_batch(num_prompts: int = 4, group: int = 8, length: int = 6, seed: int = 0, *,
               stale: Collection[int] = (), trainer_stale: Collection[int] = (), offset: float = 0.3,
               noise: float = 1e-7, mask: Sequence[np.ndarray] | None = None) -> StepBatch:
    """`num_prompts` prompts x `group` samples of `length` tokens; a prompt's samples share their first 3
    tokens and part after. Both sides score each token as a function of its context (the trainer
    `noise` nats above); the engine scores the first 2 tokens of the sequences in `stale` `offset` nats
    lower (a state left by another request), the trainer those in `trainer_stale`."""
    rng = np.random.default_rng(seed)
    prompts, tokens, lr, lt = [], [], [], []
    early = np.arange(length) < 2
    for p in range(num_prompts):
        prompt, head = rng.integers(5, 100, 7), rng.integers(100, 200, 3)
        for g in range(group):
            toks = np.concatenate([head, rng.integers(200, 2000, length - 3)])
            base = -np.abs(np.sin(toks * 0.37 + p)) - 0.05  # a function of the context's tokens
            i = p * group + g
            prompts.append(prompt)
            tokens.append(toks)
            lr.append(base - (offset if i in stale else 0.0) * early)
            lt.append(base + noise - (offset if i in trainer_stale else 0.0) * early)
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, tokens=tokens, prompt_tokens=prompts,
                                 request_ids=[f"r{i}" for i in range(len(lr))], mask=mask)
