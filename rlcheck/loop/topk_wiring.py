"""Beyond the sampled token, in the loop: when the rollout engine returns its top-K logprobs
(`VLLMConfig.top_logprobs` = K > 0), the trainer's recompute scores the same positions' logprobs at the
engine's top-K ids and its own top-K ids in the same chunked pass (`PolicyTrainer.topk_logprobs`), and
the step's `StepBatch` carries both as a `TopK` (the Monitor's `rlcheck/dist/*` metrics, with
`StatsConfig(distribution=True)`). An MoE engine's rollouts carry their experts (`Rollout.experts`,
`VLLMConfig.moe_routing`); the trainer's routers are then read in the same forward and the batch
carries both sides' `Routing` (the Monitor's `rlcheck/moe/*` metrics).

    logp_train, topk, routing = recompute(group, seqs, plan, rollouts, cfg.rollout.top_logprobs)  # TopK, Routing or None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.moe import Routing
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
              top_k: int) -> tuple[list[np.ndarray], TopK | None, Routing | None]:
    """The trainer's response-token logprobs of every sequence; with `top_k` > 0 the step's `TopK`
    (engine top-K ids and logprobs, the trainer's logprobs at those ids and its own top-K ids); when
    the engine recorded every rollout's MoE experts (`Rollout.experts`), the step's `Routing` with
    the trainer's experts from the same forward; all one forward per micro-batch. Neither asked:
    `group.logprobs`."""
    routing = bool(rollouts) and all(getattr(r, "experts", None) is not None for r in rollouts)
    if not top_k and not routing:
        return group.logprobs(seqs, plan), None, None
    engine = engine_topk(rollouts, top_k) if top_k else None
    asked = seqs if engine is None else dataclasses.replace(seqs, topk_ids=tuple(ids for ids, _ in engine))
    scored = group.topk_logprobs(asked, plan, top_k, routing)  # per sequence: (logp, logp_at, own ids[, experts])
    topk = None if engine is None else TopK.from_ragged(
        ids_rollout=[ids for ids, _ in engine],
        logp_rollout=[lp for _, lp in engine],
        logp_train=[s[1] for s in scored],
        ids_train=[s[2] for s in scored],
    )
    moe = Routing.from_sequences([r.experts for r in rollouts], [s[3] for s in scored]) if routing else None
    return [s[0] for s in scored], topk, moe
