"""Beyond the sampled token, in the loop: when the rollout engine returns its top-K logprobs
(`VLLMConfig.top_logprobs` = K > 0), the trainer's recompute scores the same positions' logprobs at the
engine's top-K ids and its own top-K ids in the same chunked pass (`PolicyTrainer.topk_logprobs`), and
the step's `StepBatch` carries both as a `TopK` (the Monitor's `rlcheck/dist/*` metrics, with
`StatsConfig(distribution=True)`).

    logp_train, topk = recompute(group, seqs, plan, rollouts, cfg.rollout.top_logprobs)   # topk: TopK | None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.topk import TopK, from_engine_dicts
from rlcheck.errors import InputError
from rlcheck.trainers import MicroBatchPlan, Sequences

DEFAULT_TOP_K = 20
"""K when top-k distribution metrics are turned on without a number (`rlcheck demo --topk`)."""


def engine_topk(rollouts: Sequence[Any], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rollout, the engine's top-`k` (ids (L, k) int64, logp (L, k) float32) of every response
    token, from its per-position dicts (which also hold the sampled token: dropped unless in the top-k)."""
    out = []
    for r in rollouts:
        if r.top_logprobs is None or len(r.top_logprobs) != len(r.token_ids):
            raise InputError(f"rollout {r.request_id} has no top-k logprobs for every token: "
                             f"start the engine with VLLMConfig(top_logprobs={k})")
        out.append(from_engine_dicts(r.top_logprobs, k))
    return out


def recompute(group, seqs: Sequences, plan: MicroBatchPlan, rollouts: Sequence[Any],
              top_k: int) -> tuple[list[np.ndarray], TopK | None]:
    """The trainer's response-token logprobs of every sequence, and with `top_k` > 0 the step's `TopK`
    (engine top-K ids and logprobs, the trainer's logprobs at those ids and its own top-K ids), all
    from one forward per micro-batch; `top_k` 0: `group.logprobs`, no `TopK`."""
    if not top_k:
        return group.logprobs(seqs, plan), None
    engine = engine_topk(rollouts, top_k)
    asked = dataclasses.replace(seqs, topk_ids=tuple(ids for ids, _ in engine))
    scored = group.topk_logprobs(asked, plan, top_k)  # per sequence: (logp, logp_at, own ids)
    topk = TopK.from_ragged(
        ids_rollout=[ids for ids, _ in engine],
        logp_rollout=[lp for _, lp in engine],
        logp_train=[at for _, at, _ in scored],
        ids_train=[own for _, _, own in scored],
    )
    return [lp for lp, _, _ in scored], topk
