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
    turns                     Turns        optional: each token's model turn, tool tokens marked, and what the
                                           engine saw per turn (`rlcheck.core.turns`: multi-turn rollouts)
    device_tensors            dict or None the packed fields as torch tensors on the caller's GPU
                                           (`rlcheck.core.batch_torch`; the statistics read them)

Build one with `from_ragged` (a list per sequence), `from_padded` ([B, T] tensors and a response
mask, as verl and TRL hold them) or `from_packed` (each with `turns=`), a multi-turn one with
`from_turns` (one `Trajectory` of `Turn`s per sequence) or `with_turns`; `StepBatch.concat` (or `concat_batches`) joins
several (the ranks' batches of one step, for its dump). Every constructor validates and raises
`rlcheck.errors.InputError` naming the problem; offsets and counts are int64 throughout (reading and
packing the constructors' inputs: `rlcheck.core.batch_build`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.core.batch_build import (
    bool_array,
    int_array,
    packed_from_padded,
    packed_from_ragged,
    padded_spans,
    request_id_tuple,
    segment_token_indices,  # noqa: F401 - importable from here
    to_numpy,
    two_sides,
    version_array,
)
from rlcheck.core.batch_join import concat_fields, select_fields
from rlcheck.core.batch_torch import device_packed, device_padded, host_copies
from rlcheck.core.limits import MAX_LOGPROB
from rlcheck.core.moe import Routing
from rlcheck.core.topk import TopK
from rlcheck.core.turns import JoinEdits, TurnRecord, Turns
from rlcheck.core.turns_build import Trajectory, ragged_index, resolve, trajectories_ragged
from rlcheck.errors import InputError

__all__ = ["MAX_LOGPROB", "StepBatch", "TopK", "Turns", "concat_batches", "segment_token_indices", "to_numpy"]


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
    turns: Turns | None = None  # (M,) per field: multi-turn structure (rlcheck.core.turns)
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
        turns: Any = None,
        turn_records: Sequence[TurnRecord | None] | None = None,
        join: JoinEdits | None = None,
    ) -> StepBatch:
        """From packed 1-D arrays and sequence boundaries `cu_seqlens` (N+1 offsets); `weight_version`:
        one int or one per sequence; `topk`, `routing`: one row per token (the module docstring);
        `turns`: a `Turns`, "mask_runs" or a (M,) turn index with negatives on tool tokens, and its
        `turn_records` (one per sequence) and `join` edits (`rlcheck.core.turns_build.resolve`)."""
        tensors = device_packed(logp_rollout, logp_train, cu_seqlens, mask, tokens, tokens_train)
        lr, lt = two_sides(logp_rollout, logp_train)
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
            turns=resolve(turns, cu, None if mask is None else bool_array(mask, "mask"), turn_records, join),
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
        turns: Any = None,
        turn_records: Sequence[TurnRecord | None] | None = None,
        join: JoinEdits | None = None,
    ) -> StepBatch:
        """From one 1-D array (or list) per sequence for each per-token field (`topk`, `routing`: one row
        per token in that order: `TopK.from_ragged`, `Routing.from_sequences`; `turns`: as `from_packed`'s,
        a turn index given per sequence too)."""
        packed = packed_from_ragged(logp_rollout, logp_train, tokens, mask, tokens_train)
        return cls.from_packed(request_ids=request_ids, prompt_tokens=prompt_tokens, meta=meta,
                               weight_version=weight_version, topk=topk, routing=routing,
                               turns=ragged_index(turns, len(logp_rollout)), turn_records=turn_records, join=join,
                               **packed)

    @classmethod
    def from_turns(cls, trajectories: Sequence[Trajectory], request_ids: Sequence[str], *,
                   join: JoinEdits | None = None, meta: Mapping[str, Sequence[Any]] | None = None,
                   weight_version: Any = None) -> StepBatch:
        """A multi-turn batch from one `Trajectory` of `Turn`s per sequence (`rlcheck.core.turns_build`:
        the layout, and what is recorded for the cross-turn invariants)."""
        r = trajectories_ragged(trajectories, join)
        return cls.from_ragged(r["logp_rollout"], r["logp_train"], request_ids, r["tokens"], mask=r["mask"],
                               tokens_train=r["tokens_train"], prompt_tokens=r["prompt_tokens"], meta=meta,
                               weight_version=weight_version, turns=r["index"], turn_records=r["records"], join=join)

    def with_turns(self, turns: Any = "mask_runs", records: Sequence[TurnRecord | None] | None = None,
                   join: JoinEdits | None = None) -> StepBatch:
        """This batch with its turn structure (`turns` as `from_packed` takes it; default: the runs of 1
        in the mask); its device tensors, if any, kept."""
        batch = dataclasses.replace(self, turns=resolve(turns, self.cu_seqlens, self.mask, records, join))
        object.__setattr__(batch, "device_tensors", self.device_tensors)
        return batch

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
        turns: Any = None,
        turn_records: Sequence[TurnRecord | None] | None = None,
        join: JoinEdits | None = None,
    ) -> StepBatch:
        """From [B, T] tensors and a [B, T] response mask (verl `response_mask`, TRL `completion_mask`);
        `topk` has B*T rows, row b*T + t for position (b, t) (the [B, T, K] arrays reshaped); `turns`:
        "mask_runs" or a [B, T] turn index (negatives on tool tokens), as `from_packed`'s.

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
        if turns is not None and not isinstance(turns, (str, Turns)):
            turns = int_array(turns, "turns")[padded_spans(bool_array(mask, "mask"))]  # (M,) as the tokens
        batch = cls.from_packed(request_ids=request_ids, prompt_tokens=prompt_tokens, meta=meta,
                                weight_version=weight_version, turns=turns, turn_records=turn_records, join=join,
                                **packed)
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
        if self.turns is not None:
            self.turns.check(cu, n)

    # ---- slicing -------------------------------------------------------------------------------

    def select(self, seq_indices: Sequence[int] | np.ndarray) -> StepBatch:
        """A new batch of the given sequences, in the given order (used for splits and dumps)."""
        return StepBatch(**select_fields(self, seq_indices))

    # ---- joining -------------------------------------------------------------------------------

    @classmethod
    def concat(cls, batches: Sequence[StepBatch]) -> StepBatch:
        """One batch of several batches' sequences, in the given order (ranks' batches in rank order, so
        indices count from the first batch's first sequence, as `rlcheck.distributed` numbers offenders).
        A batch without a mask counts all its tokens (so the joined mask is theirs and True elsewhere);
        tokens, prompts, meta columns, weight versions, top-k, routing and turns are kept when every batch
        has them; request ids must stay unique across the batches. One batch is returned as it is."""
        if not batches:
            raise InputError("concat_batches needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        return cls.from_packed(**concat_fields(batches))

def concat_batches(batches: Sequence[StepBatch]) -> StepBatch:
    """`StepBatch.concat(batches)`: one batch of several batches' sequences, in the given order."""
    return StepBatch.concat(batches)
