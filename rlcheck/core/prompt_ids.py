"""The trainer's prompt token ids beside the engine's: an optional per-sequence column of a `StepBatch`
(`meta[PROMPT_TOKENS_TRAIN]`, one id list per sequence; the engine's are `StepBatch.prompt_tokens`),
and the critical alarm when the two differ: the trainer conditioned the response on another prompt
(a chat template applied twice, BOS added twice, a tokenizer that is not the engine's).

    batch = dataclasses.replace(batch, meta={**batch.meta, PROMPT_TOKENS_TRAIN: trainer_prompts})
    alarms = prompt_alarms(step, batch)      # [] when they agree, or either side is missing
    monitor.observe(step, batch, alarms=alarms)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.types import Alarm

PROMPT_TOKENS_TRAIN = "prompt_tokens_train"
"""The `StepBatch.meta` column (and dump column) of the trainer's prompt ids."""
PROMPT_MISMATCH_COUNT = "rlcheck/sig/prompt_mismatch_count"
"""The metric a prompt-id alarm is about: sequences whose two prompts differ."""
SIGNATURE = "prompt_id_mismatch"


def differing(engine: Sequence[Any], trainer: Sequence[Any]) -> list[int]:
    """Indices of the sequences whose engine and trainer prompt ids differ."""
    return [i for i, (a, b) in enumerate(zip(engine, trainer, strict=True))
            if not np.array_equal(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))]


def prompt_alarms(step: int, batch: Any) -> list[Alarm]:
    """A critical signature alarm when the trainer's prompt ids (`PROMPT_TOKENS_TRAIN`) differ from the
    engine's (`prompt_tokens`) on any sequence; [] when they agree or either is missing."""
    trainer = batch.meta.get(PROMPT_TOKENS_TRAIN)
    if trainer is None or batch.prompt_tokens is None:
        return []
    return alarms_of(step, batch.prompt_tokens, trainer, batch.request_ids)


def alarms_of(step: int, engine: Sequence[Any], trainer: Sequence[Any], request_ids: Sequence[str]) -> list[Alarm]:
    """`prompt_alarms` on the two sides' prompt ids given as lists (a dump's rows)."""
    hit = differing(engine, trainer)
    if not hit:
        return []
    i = hit[0]
    a, b = [int(t) for t in engine[i]], [int(t) for t in trainer[i]]
    return [Alarm("signature", PROMPT_MISMATCH_COUNT, step, "critical",
                  f"{len(hit)} of {len(engine)} sequences were scored by the trainer after other prompt ids than the "
                  f"engine's (e.g. {request_ids[i]}: engine {a[:6]}... ({len(a)} ids), trainer {b[:6]}... ({len(b)} ids))",
                  {"signature": SIGNATURE, "count": len(hit), "frac": len(hit) / len(engine),
                   "request_ids": [request_ids[j] for j in hit[:50]]})]
