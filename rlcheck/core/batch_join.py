"""The fields of a `StepBatch`'s sequences picked (`select_fields`) or of several batches joined
(`concat_fields`): the keyword arguments `StepBatch.select` and `StepBatch.concat` build from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.batch_build import segment_token_indices
from rlcheck.core.moe import Routing
from rlcheck.core.topk import TopK
from rlcheck.core.turns import Turns


def select_fields(batch: Any, seq_indices: Sequence[int] | np.ndarray) -> dict[str, Any]:
    """The fields of `batch`'s sequences `seq_indices`, in that order (the StepBatch constructor's)."""
    idx = np.asarray(seq_indices, dtype=np.int64)
    starts, ends = batch.cu_seqlens[idx], batch.cu_seqlens[idx + 1]
    lens = ends - starts
    cu = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    tok = segment_token_indices(starts, lens)  # (M',)

    def take(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[tok]

    return dict(
        logp_rollout=batch.logp_rollout[tok],
        logp_train=batch.logp_train[tok],
        cu_seqlens=cu,
        request_ids=tuple(batch.request_ids[i] for i in idx),
        mask=take(batch.mask),
        tokens=take(batch.tokens),
        tokens_train=take(batch.tokens_train),
        prompt_tokens=None if batch.prompt_tokens is None else tuple(batch.prompt_tokens[i] for i in idx),
        meta={k: [v[i] for i in idx] for k, v in batch.meta.items()},
        weight_version=None if batch.weight_version is None else batch.weight_version[idx],
        topk=None if batch.topk is None else batch.topk.take(tok),
        routing=None if batch.routing is None else batch.routing.take(tok),
        turns=None if batch.turns is None else batch.turns.take(tok, idx),
    )


def concat_fields(batches: Sequence[Any]) -> dict[str, Any]:
    """The arguments of `StepBatch.from_packed` for several batches' sequences, in order (see
    `StepBatch.concat`)."""
    offsets = np.cumsum([0] + [b.num_tokens for b in batches[:-1]])  # (K,) first token of each batch
    cu = np.concatenate([[0]] + [b.cu_seqlens[1:] + off for b, off in zip(batches, offsets, strict=True)])

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(b, name) for b in batches]
        return None if any(p is None for p in parts) else np.concatenate(parts)

    masks = [np.ones(b.num_tokens, dtype=bool) if b.mask is None else b.mask for b in batches]
    any_mask = any(b.mask is not None for b in batches)
    prompts = [b.prompt_tokens for b in batches]
    keys = set(batches[0].meta).intersection(*(b.meta for b in batches[1:]))
    return dict(
        logp_rollout=cat("logp_rollout"), logp_train=cat("logp_train"), cu_seqlens=cu.astype(np.int64),
        request_ids=[r for b in batches for r in b.request_ids],
        mask=np.concatenate(masks) if any_mask else None, tokens=cat("tokens"), tokens_train=cat("tokens_train"),
        prompt_tokens=None if any(p is None for p in prompts) else [t for p in prompts for t in p],
        meta={k: [v for b in batches for v in b.meta[k]] for k in sorted(keys)},
        weight_version=cat("weight_version"),
        topk=None if any(b.topk is None for b in batches) else TopK.concat([b.topk for b in batches]),
        routing=None if any(b.routing is None for b in batches) else Routing.concat([b.routing for b in batches]),
        turns=None if any(b.turns is None for b in batches)
        else Turns.concat([b.turns for b in batches], [b.num_sequences for b in batches]),
    )
