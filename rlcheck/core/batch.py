"""The data contract: one training step's rollout and trainer logprobs, packed without padding.

A `StepBatch` holds M response tokens of N sequences back to back (flash-attn varlen layout):

    logp_rollout, logp_train  (M,) float   log p of each sampled token, engine vs trainer
    cu_seqlens                (N+1,) int64 sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    request_ids               N strings    the engine's request id, unique, carried to the dump
    mask                      (M,) bool    optional: tokens that count
    tokens, tokens_train      (M,) int64   optional: sampled ids, and the ids the trainer scored
    weight_version            (N,) int64   optional: the weights version that generated each sequence
                                           (compared with `Monitor.observe(..., trainer_version=V)`)
    topk                      TopK         optional: both sides' top-K logprobs, one row per token
                                           (`rlcheck.core.topk`; dumps do not store it)
    routing                   Routing      optional: both sides' MoE experts per token (`rlcheck.core.moe`)
    device_tensors            dict or None the packed fields as torch tensors on the caller's GPU
                                           (`rlcheck.core.batch_torch`; the statistics read them)

Build one with `from_ragged` (a list per sequence), `from_padded` ([B, T] tensors and a response
mask, as verl and TRL hold them) or `from_packed`; `StepBatch.concat` (or `concat_batches`) joins
several (the ranks' batches of one step, for its dump). Every constructor validates and raises
`rlcheck.errors.InputError` naming the problem; offsets and counts are int64 throughout (reading and
packing the constructors' inputs: `rlcheck.core.batch_build`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.core.batch_build import (
    bool_array,
    float_array,
    int_array,
    packed_from_padded,
    packed_from_ragged,
    request_id_tuple,
    to_numpy,
    version_array,
)
from rlcheck.core.batch_torch import device_packed, device_padded, host_copies
from rlcheck.core.limits import MAX_LOGPROB
from rlcheck.core.moe import Routing
from rlcheck.core.topk import TopK
from rlcheck.errors import InputError

__all__ = ["MAX_LOGPROB", "StepBatch", "TopK", "concat_batches", "segment_token_indices", "to_numpy"]


def segment_token_indices(starts: Any, lens: Any) -> np.ndarray:
    """(sum(lens),) int64 indices of the tokens of segments [starts[i], starts[i] + lens[i]), in order;
    equal to `np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])`, without the loop.
    All offset arithmetic is int64, so offsets past 2**32 do not wrap."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)  # (N,) each
    offs = np.zeros(lens.shape[0] + 1, dtype=np.int64)  # (N+1,) where segment i lands in the output
    np.cumsum(lens, out=offs[1:])
    return np.repeat(starts - offs[:-1], lens) + np.arange(offs[-1], dtype=np.int64)


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One step's packed comparison data; see the module docstring for the layout."""

    logp_rollout: np.ndarray  # (M,) float
    logp_train: np.ndarray  # (M,) float
    cu_seqlens: np.ndarray  # (N+1,) int64
    request_ids: tuple[str, ...]  # N
    mask: np.ndarray | None = None  # (M,) bool
    tokens: np.ndarray | None = None  # (M,) int64
    tokens_train: np.ndarray | None = None  # (M,) int64
    prompt_tokens: tuple[np.ndarray, ...] | None = None  # N arrays of int64
    meta: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # per-sequence columns
    weight_version: np.ndarray | None = None  # (N,) int64
    topk: TopK | None = None  # (M, K) per field
    routing: Routing | None = None  # (M, L, k) per side: MoE experts (rlcheck.core.moe)
    device_tensors: Mapping[str, Any] | None = field(default=None, init=False, compare=False, repr=False)
    """The packed fields as torch tensors on the device the caller's tensors were on (a GPU), which the
    statistics read instead of the numpy fields; None for host data. Set by `from_padded` and
    `from_packed` only: a batch derived from this one (`dataclasses.replace`, `select`) has none."""

    def __post_init__(self) -> None:
        self._validate()

    @property
    def num_tokens(self) -> int:
        return int(self.logp_rollout.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    @property
    def seq_lens(self) -> np.ndarray:
        """(N,) int64 length of every sequence."""
        return np.diff(self.cu_seqlens)

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_packed(
        cls,
        logp_rollout: Any,
        logp_train: Any,
        cu_seqlens: Any,
        request_ids: Sequence[str],
        *,
        mask: Any = None,
        tokens: Any = None,
        tokens_train: Any = None,
        prompt_tokens: Sequence[Any] | None = None,
        meta: Mapping[str, Sequence[Any]] | None = None,
        weight_version: Any = None,
        topk: TopK | None = None,
        routing: Routing | None = None,
    ) -> StepBatch:
        """From packed 1-D arrays and sequence boundaries `cu_seqlens` (N+1 offsets); `weight_version`:
        one int or one per sequence; `topk`, `routing`: one row per token (the module docstring)."""
        tensors = device_packed(logp_rollout, logp_train, cu_seqlens, mask, tokens, tokens_train)
        lr = float_array(logp_rollout, "logp_rollout")
        lt = float_array(logp_train, "logp_train")
        cu = int_array(cu_seqlens, "cu_seqlens")
        if cu.ndim != 1 or cu.shape[0] < 1:
            raise InputError("cu_seqlens: expected a 1-D array of N+1 sequence offsets")
        batch = cls(
            logp_rollout=lr,
            logp_train=lt,
            cu_seqlens=cu,
            request_ids=request_id_tuple(request_ids, cu.shape[0] - 1),
            mask=None if mask is None else bool_array(mask, "mask"),
            tokens=None if tokens is None else int_array(tokens, "tokens"),
            tokens_train=None if tokens_train is None else int_array(tokens_train, "tokens_train"),
            prompt_tokens=None
            if prompt_tokens is None
            else tuple(int_array(p, f"prompt_tokens[{i}]").reshape(-1) for i, p in enumerate(prompt_tokens)),
            meta=dict(meta or {}),
            weight_version=None if weight_version is None else version_array(weight_version, cu.shape[0] - 1),
            topk=topk,
            routing=routing,
        )
        object.__setattr__(batch, "device_tensors", tensors)
        return batch

    @classmethod
    def from_ragged(
        cls,
        logp_rollout: Sequence[Any],
        logp_train: Sequence[Any],
        request_ids: Sequence[str],
        tokens: Sequence[Any] | None = None,
        *,
        mask: Sequence[Any] | None = None,
        tokens_train: Sequence[Any] | None = None,
        prompt_tokens: Sequence[Any] | None = None,
        meta: Mapping[str, Sequence[Any]] | None = None,
        weight_version: Any = None,
        topk: TopK | None = None,
        routing: Routing | None = None,
    ) -> StepBatch:
        """From one 1-D array (or list) per sequence for each per-token field (`topk`, `routing`: one row
        per token in that order: `TopK.from_ragged`, `Routing.from_sequences`)."""
        packed = packed_from_ragged(logp_rollout, logp_train, tokens, mask, tokens_train)
        return cls.from_packed(request_ids=request_ids, prompt_tokens=prompt_tokens, meta=meta,
                               weight_version=weight_version, topk=topk, routing=routing, **packed)

    @classmethod
    def from_padded(
        cls,
        logp_rollout: Any,
        logp_train: Any,
        mask: Any,
        request_ids: Sequence[str],
        *,
        tokens: Any = None,
        tokens_train: Any = None,
        prompt_tokens: Sequence[Any] | None = None,
        meta: Mapping[str, Sequence[Any]] | None = None,
        weight_version: Any = None,
        topk: TopK | None = None,
    ) -> StepBatch:
        """From [B, T] tensors and a [B, T] response mask (verl `response_mask`, TRL `completion_mask`);
        `topk` has B*T rows, row b*T + t for position (b, t) (the [B, T, K] arrays reshaped).

        Row b becomes one sequence spanning its first to its last masked-in token; masked-out tokens
        inside that span (tool output, say) stay in the sequence as masked tokens, so positions such
        as the first divergence are counted from the start of the response. Tensors on a GPU are packed
        there (`rlcheck.core.batch_torch`): only the packed tokens are copied to the host.
        """
        tensors = None if topk is not None else device_padded(logp_rollout, logp_train, mask, tokens, tokens_train)
        if tensors is None:
            packed = packed_from_padded(logp_rollout, logp_train, mask, tokens, tokens_train, topk)
        else:
            packed = host_copies(tensors)
        batch = cls.from_packed(request_ids=request_ids, prompt_tokens=prompt_tokens, meta=meta,
                                weight_version=weight_version, **packed)
        object.__setattr__(batch, "device_tensors", tensors)
        return batch

    # ---- validation ----------------------------------------------------------------------------

    def _validate(self) -> None:
        lr, lt, cu = self.logp_rollout, self.logp_train, self.cu_seqlens
        if lr.ndim != 1 or lt.ndim != 1:
            raise InputError(f"packed logprobs must be 1-D, got shapes {lr.shape} and {lt.shape}")
        if lr.shape != lt.shape:
            raise InputError(f"logp_rollout has {lr.shape[0]} tokens, logp_train has {lt.shape[0]}")
        if cu.dtype != np.int64:
            raise InputError(f"cu_seqlens must be int64, got {cu.dtype}")
        n = cu.shape[0] - 1
        if n == 0:
            raise InputError("empty batch: no sequences to compare")
        if cu[0] != 0 or cu[-1] != lr.shape[0]:
            raise InputError(
                f"cu_seqlens must start at 0 and end at the token count {lr.shape[0]}, "
                f"got {int(cu[0])}..{int(cu[-1])}"
            )
        if n > 0 and (np.diff(cu) < 0).any():
            bad = int(np.flatnonzero(np.diff(cu) < 0)[0])
            raise InputError(f"cu_seqlens decreases at sequence {bad}: offsets must be non-decreasing")
        if len(self.request_ids) != n:
            raise InputError(f"request_ids: {len(self.request_ids)} ids for {n} sequences")
        for name in ("mask", "tokens", "tokens_train"):
            a = getattr(self, name)
            if a is not None and a.shape != lr.shape:
                raise InputError(f"{name} has shape {a.shape}, the logprobs have {lr.shape}")
        # every token masked out, or no token at all, is allowed: the Monitor logs such a step as empty
        for name, a in (("logp_rollout", lr), ("logp_train", lt)) if lr.shape[0] else ():
            top = a.max()  # NaN when a NaN is present: then look token by token
            if top > MAX_LOGPROB or (np.isnan(top) and (a > MAX_LOGPROB).any()):
                i = int(np.flatnonzero(a > MAX_LOGPROB)[0])
                seq = int(np.searchsorted(cu, i, side="right") - 1)
                raise InputError(
                    f"{name}: value {float(a[i]):.4g} > 0 at token {i} (sequence {seq}, request "
                    f"{self.request_ids[seq]!r}); log-probabilities are <= 0: were logits or "
                    "probabilities passed?"
                )
        if self.prompt_tokens is not None and len(self.prompt_tokens) != n:
            raise InputError(f"prompt_tokens has {len(self.prompt_tokens)} entries for {n} sequences")
        for key, col in self.meta.items():
            if len(col) != n:
                raise InputError(f"meta[{key!r}] has {len(col)} entries for {n} sequences")
        if self.weight_version is not None and self.weight_version.shape != (n,):
            raise InputError(f"weight_version has shape {self.weight_version.shape} for {n} sequences")
        if self.topk is not None and self.topk.num_tokens != lr.shape[0]:
            raise InputError(f"topk has {self.topk.num_tokens} rows for {lr.shape[0]} tokens (one row per token)")
        if self.routing is not None:
            self.routing.check_tokens(lr.shape[0])

    # ---- slicing -------------------------------------------------------------------------------

    def select(self, seq_indices: Sequence[int] | np.ndarray) -> StepBatch:
        """A new batch of the given sequences, in the given order (used for splits and dumps)."""
        idx = np.asarray(seq_indices, dtype=np.int64)
        starts, ends = self.cu_seqlens[idx], self.cu_seqlens[idx + 1]
        lens = ends - starts
        cu = np.zeros(idx.shape[0] + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        tok = segment_token_indices(starts, lens)  # (M',)

        def take(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[tok]

        return StepBatch(
            logp_rollout=self.logp_rollout[tok],
            logp_train=self.logp_train[tok],
            cu_seqlens=cu,
            request_ids=tuple(self.request_ids[i] for i in idx),
            mask=take(self.mask),
            tokens=take(self.tokens),
            tokens_train=take(self.tokens_train),
            prompt_tokens=None if self.prompt_tokens is None else tuple(self.prompt_tokens[i] for i in idx),
            meta={k: [v[i] for i in idx] for k, v in self.meta.items()},
            weight_version=None if self.weight_version is None else self.weight_version[idx],
            topk=None if self.topk is None else self.topk.take(tok),
            routing=None if self.routing is None else self.routing.take(tok),
        )

    # ---- joining -------------------------------------------------------------------------------

    @classmethod
    def concat(cls, batches: Sequence[StepBatch]) -> StepBatch:
        """One batch of several batches' sequences, in the given order (ranks' batches in rank order, so
        indices count from the first batch's first sequence, as `rlcheck.distributed` numbers offenders).
        A batch without a mask counts all its tokens (so the joined mask is theirs and True elsewhere);
        tokens, prompts, meta columns, weight versions, top-k and routing are kept when every batch has
        them; request ids must stay unique across the batches. One batch is returned as it is."""
        if not batches:
            raise InputError("concat_batches needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        offsets = np.cumsum([0] + [b.num_tokens for b in batches[:-1]])  # (K,) first token of each batch
        cu = np.concatenate([[0]] + [b.cu_seqlens[1:] + off for b, off in zip(batches, offsets, strict=True)])

        def cat(name: str) -> np.ndarray | None:
            parts = [getattr(b, name) for b in batches]
            return None if any(p is None for p in parts) else np.concatenate(parts)

        masks = [np.ones(b.num_tokens, dtype=bool) if b.mask is None else b.mask for b in batches]
        any_mask = any(b.mask is not None for b in batches)
        prompts = [b.prompt_tokens for b in batches]
        keys = set(batches[0].meta).intersection(*(b.meta for b in batches[1:]))
        return cls.from_packed(
            cat("logp_rollout"), cat("logp_train"), cu.astype(np.int64),
            [r for b in batches for r in b.request_ids],
            mask=np.concatenate(masks) if any_mask else None, tokens=cat("tokens"), tokens_train=cat("tokens_train"),
            prompt_tokens=None if any(p is None for p in prompts) else [t for p in prompts for t in p],
            meta={k: [v for b in batches for v in b.meta[k]] for k in sorted(keys)},
            weight_version=cat("weight_version"),
            topk=None if any(b.topk is None for b in batches) else TopK.concat([b.topk for b in batches]),
            routing=None if any(b.routing is None for b in batches) else Routing.concat([b.routing for b in batches]),
        )


def concat_batches(batches: Sequence[StepBatch]) -> StepBatch:
    """`StepBatch.concat(batches)`: one batch of several batches' sequences, in the given order."""
    return StepBatch.concat(batches)
