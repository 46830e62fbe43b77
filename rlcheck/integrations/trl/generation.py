"""One TRL generation as the Monitor's `StepBatch`: the output of `_generate_and_score_completions`, its
request ids and per-row meta (`rlcheck.integrations.trl.batch`), the trainer's logprobs (TRL's
`old_per_token_logps`, or one no-grad forward where TRL did not compute them) and, with top-k on, both
sides' top-K (`rlcheck.integrations.trl.topk`). Where a new kind of generation (tools, several turns)
changes what a row holds, this is where it becomes a batch.
"""

from __future__ import annotations

from typing import Any

from rlcheck.core.batch import StepBatch
from rlcheck.integrations.trl.batch import TRAIN_KEY, request_ids, row_meta, to_step_batch
from rlcheck.integrations.trl.loss import MULTIMODAL_KEYS
from rlcheck.integrations.trl.topk import build_step_topk


def generation_batch(trainer: Any, output: dict, step: int, rank: int, weight_version: int | None,
                     logp_train: Any, engine_topk: Any = None, topk_rows: Any = None) -> StepBatch:
    """The `StepBatch` of one generation on process `rank`: rollouts generated on `weight_version`, the trainer's
    logprobs `logp_train` (`trainer_logps`); `engine_topk` (an `EngineTopK`, None with top-k off) with
    `topk_rows`, vLLM's top-k of its completions."""
    rows = output["completion_mask"].shape[0]
    meta = row_meta(rank, rows, trainer.num_generations, weight_version)
    topk = None if engine_topk is None else build_step_topk(trainer, output, topk_rows, engine_topk.k)
    return to_step_batch(output, request_ids(step, rank, rows), logp_train=logp_train, meta=meta,
                         weight_version=weight_version, topk=topk)


def trainer_logps(trainer: Any, output: dict) -> Any:
    """(B, C) the trainer's logprobs of the sampled tokens: TRL's `old_per_token_logps`, else `recompute`d once
    (the batch and the measured floor both read them)."""
    logps = output.get(TRAIN_KEY)
    return recompute(trainer, output) if logps is None else logps


def recompute(trainer: Any, output: dict, model: Any = None) -> Any:
    """The trainer's logprobs of the sampled tokens, when TRL did not compute them (importance
    sampling off and generation aligned with the optimizer step): one extra no-grad forward. `model`:
    another copy of the policy to score them with (`rlcheck.integrations.trl.floor`), else the trainer's."""
    import torch

    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+C)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+C)
    extra = {k: output[k] for k in MULTIMODAL_KEYS if k in output}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model if model is None else model, ids, attention, output["completion_ids"].size(1),
            batch_size=trainer.args.per_device_train_batch_size, **extra,
        )
    return logps
