"""Turns: which model call of a multi-turn trajectory each response token came from.

An agent's trajectory is one flat token sequence: the model's output of call 0, the tool's (or the
environment's) reply, the model's output of call 1, ... A `StepBatch` carries that structure in
`StepBatch.turns`, packed like its tokens:

    index  (M,) int64  the model turn of each token: 0, 1, ... in order within its sequence; a tool or
                       observation token holds the turn it follows (0 before the first one)
    tool   (M,) bool   tool / observation / template tokens: not sampled by the model
    source str         "explicit" (the adapter knew the boundaries) or "mask_runs" (runs of 1 in
                       the loss mask, for frameworks that keep none: verl, TRL, slime)
    records            per sequence, optional: what the engine saw at each call (`TurnRecord`), for
                       the cross-turn invariants (`rlcheck.core.turn_checks`)
    join               the join edits the adapter declares (`JoinEdits`): tokens its framework
                       inserts or removes between a model turn and what follows

The model tokens of one turn are one contiguous run, and turns are numbered 0, 1, ... within their
sequence (validated: `Turns.check`). Build one with `Turns.from_mask`, `Turns.from_index` or
`Turns.from_spans`, or let `StepBatch` do it (`from_turns`, `with_turns`, `turns=` of its
constructors; `rlcheck.core.turns_build`). numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.errors import InputError

SOURCES = ("explicit", "mask_runs")


@dataclass(frozen=True)
class JoinEdits:
    """What a framework does to the ids between a model turn and what follows it, as the adapter
    declares it: verl's Qwen/MiniMax builder inserts "\\n" after a sampled <|im_end|>
    (`insert_after=((im_end, (newline,)),)`); its GLM builder removes a sampled trailing
    <|observation|> / <|user|> (`remove_trailing=(obs, user)`)."""

    remove_trailing: tuple[int, ...] = ()
    """A turn whose sampled output ends with one of these ids loses it from the trained stream and
    from the next prompt."""
    insert_after: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(id, ids): after a turn whose output ends with `id`, the framework inserts `ids` (tokens the
    model did not sample: mask 0, no engine logprob)."""

    def edit(self, output_ids: np.ndarray) -> np.ndarray:
        """The ids a sampled output contributes to the next prompt, with these edits applied."""
        out = np.asarray(output_ids, dtype=np.int64)
        if out.size and int(out[-1]) in self.remove_trailing:
            return out[:-1]
        for after, ids in self.insert_after:
            if out.size and int(out[-1]) == after:
                return np.concatenate([out, np.asarray(ids, dtype=np.int64)])
        return out


def _id_tuple(parts: Any, name: str) -> tuple[np.ndarray, ...] | None:
    if parts is None:
        return None
    return tuple(np.asarray(p, dtype=np.int64).reshape(-1) for p in parts)


@dataclass(frozen=True, eq=False)
class TurnRecord:
    """What the engine saw at each model call of one trajectory (K calls); every field optional."""

    prompt_ids: tuple[np.ndarray, ...] | None = None
    """K arrays: the ids the engine prefilled for call k (the whole context up to it)."""
    output_ids: tuple[np.ndarray, ...] | None = None
    """K arrays: the ids it sampled at call k (before any join edit)."""
    logprob_counts: tuple[int, ...] | None = None
    """K: the logprobs it returned for call k (a count short of the output's: some are missing)."""
    versions: tuple[int, ...] | None = None
    """K: the weights version that served call k (slime's `Sample.weight_versions`)."""
    num_turns: int | None = None
    """The framework's own count of model turns (verl's `num_turns` converted, OpenRLHF's
    `len(action_ranges)`, verifiers' trajectory steps)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _id_tuple(self.prompt_ids, "prompt_ids"))
        object.__setattr__(self, "output_ids", _id_tuple(self.output_ids, "output_ids"))
        for name in ("logprob_counts", "versions"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(v) for v in value))
        sizes = {n: len(getattr(self, n)) for n in ("prompt_ids", "output_ids", "logprob_counts", "versions")
                 if getattr(self, n) is not None}
        if len(set(sizes.values())) > 1:
            raise InputError(f"turn record: its per-turn fields disagree on the number of turns ({sizes})")
        if self.num_turns is not None and int(self.num_turns) < 0:
            raise InputError(f"turn record: num_turns must be >= 0, got {self.num_turns}")

    @property
    def num_calls(self) -> int | None:
        """K, the engine calls recorded (None when no per-turn field is set)."""
        for name in ("prompt_ids", "output_ids", "logprob_counts", "versions"):
            value = getattr(self, name)
            if value is not None:
                return len(value)
        return None


@dataclass(frozen=True)
class TurnRuns:
    """The model turns of a batch, one entry each, in token order (R turns)."""

    start: np.ndarray  # (R,) int64 first token of the turn
    length: np.ndarray  # (R,) int64
    seq: np.ndarray  # (R,) int64 its sequence
    turn: np.ndarray  # (R,) int64 its number within the sequence
    last: np.ndarray  # (R,) bool the last turn of its sequence
    begin: np.ndarray  # (B,) int64 the first token of every run, the model's and the tool's, in order


@dataclass(frozen=True, eq=False)
class Turns:
    """The turn structure of a step's packed tokens; see the module docstring."""

    index: np.ndarray  # (M,) int64
    tool: np.ndarray  # (M,) bool
    source: str = "explicit"
    records: tuple[TurnRecord | None, ...] | None = None  # N
    join: JoinEdits | None = None
    _runs: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise InputError(f"turns: source must be one of {SOURCES}, got {self.source!r}")
        index, tool = np.asarray(self.index), np.asarray(self.tool)
        if index.ndim != 1 or tool.shape != index.shape:
            raise InputError(f"turns: index {index.shape} and tool {tool.shape} must be (M,) arrays of one shape")
        object.__setattr__(self, "index", index.astype(np.int64, copy=False))
        object.__setattr__(self, "tool", tool.astype(bool, copy=False))
        if self.records is not None:
            object.__setattr__(self, "records", tuple(self.records))
            bad = [type(r).__name__ for r in self.records if r is not None and not isinstance(r, TurnRecord)]
            if bad:
                raise InputError(f"turns: records must be TurnRecord or None, got {bad[0]}")

    @property
    def num_tokens(self) -> int:
        return int(self.index.shape[0])

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def from_mask(cls, mask: Any, cu_seqlens: Any, *, records: Sequence[TurnRecord | None] | None = None,
                  join: JoinEdits | None = None) -> Turns:
        """Turns as the runs of 1s of a loss mask (M,), within each sequence of `cu_seqlens` (N+1,):
        run k is turn k, every masked-out token a tool/observation token."""
        mask = np.asarray(mask, dtype=bool)
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        index = _number_runs(mask, cu)
        return cls(index, ~mask, "mask_runs", records, join)

    @classmethod
    def from_index(cls, index: Any, cu_seqlens: Any, *, records: Sequence[TurnRecord | None] | None = None,
                   join: JoinEdits | None = None) -> Turns:
        """Turns from a per-token turn number (M,), negative on tool/observation tokens (the layout
        verl's per-round metrics and most agent loops keep); validated like every `Turns`."""
        raw = np.asarray(index)
        if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
            raise InputError(f"turn index: expected a 1-D integer array, got {raw.dtype} {raw.shape}")
        tool = raw < 0
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        if raw.shape[0] != int(cu[-1]):
            raise InputError(f"turns: {raw.shape[0]} entries for {int(cu[-1])} tokens (one per token)")
        turns = cls(_fill_tool(raw.astype(np.int64), tool, cu), tool, "explicit", records, join)
        turns.check(cu)
        return turns

    @classmethod
    def from_spans(cls, spans: Sequence[Sequence[tuple[int, int]]], cu_seqlens: Any, *,
                   records: Sequence[TurnRecord | None] | None = None, join: JoinEdits | None = None) -> Turns:
        """Turns from explicit [start, end) token spans per sequence, counted from the sequence's first
        token (OpenRLHF's `action_ranges`, shifted to the response); tokens outside every span are
        tool/observation tokens."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        if len(spans) != cu.shape[0] - 1:
            raise InputError(f"turn spans: {len(spans)} sequences' spans for {cu.shape[0] - 1} sequences")
        index = np.full(int(cu[-1]), -1, dtype=np.int64)
        for i, seq_spans in enumerate(spans):
            length, end_prev = int(cu[i + 1] - cu[i]), 0
            for k, (a, b) in enumerate(seq_spans):
                if not 0 <= end_prev <= a < b <= length:
                    raise InputError(f"turn spans of sequence {i}: span {k} [{a}, {b}) is empty, overlaps the one "
                                     f"before or leaves the sequence (length {length})")
                index[cu[i] + a:cu[i] + b] = k
                end_prev = b
        return cls.from_index(index, cu, records=records, join=join)

    # ---- validation and derived structure --------------------------------------------------------

    def check(self, cu_seqlens: np.ndarray, num_sequences: int | None = None) -> None:
        """Raise InputError unless the model tokens of each turn form one run and the turns of every
        sequence are numbered 0, 1, ... in order; `records` must have one entry per sequence."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        if self.num_tokens != int(cu[-1]):
            raise InputError(f"turns: {self.num_tokens} entries for {int(cu[-1])} tokens (one per token)")
        num = cu.shape[0] - 1 if num_sequences is None else num_sequences
        if self.records is not None and len(self.records) != num:
            raise InputError(f"turns: {len(self.records)} records for {num} sequences (one per sequence, or None)")
        runs = self.runs(cu)
        ordinal = np.arange(runs.seq.shape[0]) - np.searchsorted(runs.seq, runs.seq, side="left")
        wrong = np.flatnonzero(runs.turn != ordinal)
        if wrong.size:
            r = int(wrong[0])
            raise InputError(
                f"turns: sequence {int(runs.seq[r])} holds turn {int(runs.turn[r])} where turn {int(ordinal[r])} was "
                f"due (token {int(runs.start[r] - cu[runs.seq[r]])}); each turn's model tokens must be one run, "
                "numbered 0, 1, ... in order")

    def runs(self, cu_seqlens: np.ndarray) -> TurnRuns:
        """The model turns (`TurnRuns`), cached per batch layout."""
        key = "runs"
        if key not in self._runs:
            self._runs[key] = _model_runs(self.index, self.tool, np.asarray(cu_seqlens, dtype=np.int64))
        return self._runs[key]

    def offsets(self, cu_seqlens: np.ndarray) -> np.ndarray:
        """(M,) int64 each token's offset in its turn (a tool token's: in its observation run)."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        m = self.num_tokens
        pos = np.arange(m, dtype=np.int64)
        new = run_starts(self.index, self.tool, cu)
        start = np.maximum.accumulate(np.where(new, pos, 0)) if m else pos
        return pos - start

    def turn_counts(self, cu_seqlens: np.ndarray) -> np.ndarray:
        """(N,) int64 model turns of every sequence."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        return np.bincount(self.runs(cu).seq, minlength=cu.shape[0] - 1).astype(np.int64)

    # ---- slicing and joining ---------------------------------------------------------------------

    def take(self, tokens: np.ndarray, sequences: np.ndarray) -> Turns:
        """The turns of the given token rows and sequences (a `StepBatch.select`)."""
        records = None if self.records is None else tuple(self.records[i] for i in np.asarray(sequences).tolist())
        return Turns(self.index[tokens], self.tool[tokens], self.source, records, self.join)

    @classmethod
    def concat(cls, parts: Sequence[Turns], num_sequences: Sequence[int]) -> Turns:
        """Several batches' turns, in order ("mask_runs" when any part is; records kept where every
        part has them, else each part's sequences None)."""
        records = None
        if any(p.records is not None for p in parts):
            records = tuple(r for p, n in zip(parts, num_sequences, strict=True)
                            for r in (p.records if p.records is not None else (None,) * n))
        source = "mask_runs" if any(p.source == "mask_runs" for p in parts) else "explicit"
        join = next((p.join for p in parts if p.join is not None), None)
        return cls(np.concatenate([p.index for p in parts]), np.concatenate([p.tool for p in parts]), source,
                   records, join)


def _seq_starts(m: int, cu: np.ndarray) -> np.ndarray:
    """(M,) bool: the first token of every non-empty sequence."""
    flags = np.zeros(m, dtype=bool)
    starts = cu[:-1][np.diff(cu) > 0]
    flags[starts] = True
    return flags


def run_starts(index: np.ndarray, tool: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """(M,) bool: where a run of one (tool, index) begins within a sequence of `cu` (N+1,)."""
    m = index.shape[0]
    new = _seq_starts(m, cu)
    if m > 1:
        new[1:] |= (tool[1:] != tool[:-1]) | (index[1:] != index[:-1])
    return new


def _model_runs(index: np.ndarray, tool: np.ndarray, cu: np.ndarray) -> TurnRuns:
    begin = np.flatnonzero(run_starts(index, tool, cu)).astype(np.int64)  # (B,) every run, both kinds
    ends = np.append(begin[1:], index.shape[0])  # a run ends where the next begins (runs break at sequences)
    model = ~tool[begin] if begin.size else np.zeros(0, dtype=bool)
    start = begin[model]  # (R,)
    seq = (np.searchsorted(cu, start, side="right") - 1).astype(np.int64)
    last = np.ones(start.shape[0], dtype=bool)
    last[:-1] = seq[1:] != seq[:-1]
    return TurnRuns(start, (ends - begin)[model], seq, index[start].astype(np.int64), last, begin)


def _number_runs(model: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """(M,) int64 turn numbers: run k of model tokens within its sequence is turn k; other tokens
    hold the turn they follow (0 before the first)."""
    m = model.shape[0]
    prev_model = np.zeros(m, dtype=bool)
    prev_model[1:] = model[:-1]
    new = model & ~(prev_model & ~_seq_starts(m, cu))  # (M,) a run of model tokens begins
    seq_of = np.repeat(np.arange(cu.shape[0] - 1), np.diff(cu))  # (M,)
    runs_before = np.cumsum(new)  # (M,) model runs begun at or before each token
    at_seq_start = np.concatenate([[0], runs_before])[cu[:-1]]  # (N,) runs begun before each sequence
    return np.maximum(runs_before - at_seq_start[seq_of] - 1, 0).astype(np.int64)


def _fill_tool(index: np.ndarray, tool: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """`index` with every tool token holding the turn of the model token before it in its sequence
    (0 before the first)."""
    m = index.shape[0]
    pos = np.arange(m, dtype=np.int64)
    seq_start = np.repeat(cu[:-1], np.diff(cu))  # (M,)
    last_model = np.maximum.accumulate(np.where(~tool, pos, -1)) if m else pos  # (M,)
    has = last_model >= seq_start
    src = np.where(has, last_model, 0)
    return np.where(tool, np.where(has, index[src] if m else 0, 0), index).astype(np.int64)
