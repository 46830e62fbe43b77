"""The pure half of replay: per-request divergence from reference logprobs, ranking, and the token
window around the first divergence. Arrays in, dataclasses out; no model, no I/O.

With d = logp_reference - logp_rollout per response token (packed over sequences, `cu` the (N+1,)
boundaries), a request's `max_abs_diff` is max |d| over its finite tokens, `first_divergence` the
first position with |d| > tau or a non-finite logprob, and requests rank by max |d|, any with a
non-finite token first (as the monitor's offenders do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from rlcheck.core.run.journal import to_jsonable
from rlcheck.core.stats.sequences import (
    divergence,
    first_positions,
    log_diff,
    packed,
    segment_max,
)

CONTEXT_TOKENS = 4
"""Tokens shown on each side of the divergent one."""


@dataclass(frozen=True)
class Context:
    """The tokens around a request's first divergence, decoded with the model's tokenizer."""

    position: int  # in the response, as first_divergence
    token_id: int
    token: str
    before: str  # up to CONTEXT_TOKENS tokens before it (prompt tokens included)
    after: str  # up to CONTEXT_TOKENS response tokens after it
    logp_rollout: float  # the engine's logprob of the divergent token
    logp_reference: float  # the reference's

    @property
    def marked(self) -> str:
        """One line: before⟦token⟧after, control characters escaped."""
        return printable(f"{self.before}⟦{self.token}⟧{self.after}")


@dataclass(frozen=True)
class ReplayRecord:
    """One request of a replayed dump."""

    request_id: str
    index: int  # row of the sequence in the dump (its position in the observed batch)
    length: int  # response tokens
    max_abs_diff: float  # max |d| vs the rollout engine, over finite tokens
    max_abs_diff_train: float | None  # max |logp_reference - logp_train|; None: the dump has no trainer side
    first_divergence: int | None  # first response position with |d| > tau (or non-finite); None if none
    max_position: int | None  # response position of the largest |d|; None for an empty response
    mean_diff: float  # mean d (signed) over finite tokens
    nonfinite: bool  # a NaN, -inf or sentinel logprob on either side
    context: Context | None = None  # around first_divergence

    @property
    def score(self) -> float:
        return math.inf if self.nonfinite else self.max_abs_diff

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (non-finite floats as strings, as in metrics.jsonl)."""
        out = asdict(self)
        if self.context is not None:
            out["context"]["marked"] = self.context.marked
        return to_jsonable(out)


def compare(
    request_ids: Sequence[str],
    reference: Sequence[np.ndarray],
    rollout: Sequence[np.ndarray],
    train: Sequence[np.ndarray] | None = None,
    *,
    tau: float,
    valid: Sequence[np.ndarray] | None = None,
    indices: Sequence[int] | None = None,
) -> list[ReplayRecord]:
    """One record per request (input order, no context yet): the reference against the rollout
    engine's logprobs and, if given, the trainer's. `valid` (bool per token) leaves masked-out tokens
    (tool output) out of every reduction."""
    ref, cu = packed(reference)
    d = log_diff(ref, packed(rollout)[0])  # (M,)
    if valid is not None:
        d[~np.concatenate(valid).astype(bool)] = 0.0
    seq_max, first = divergence(d, cu, tau)
    nonfinite = segment_max(np.isnan(d).astype(np.float64), cu) > 0
    train_max = None if train is None else divergence(log_diff(ref, packed(train)[0]), cu, tau)[0]
    lens = np.diff(cu)
    ad = np.where(np.isnan(d), -1.0, np.abs(d))
    peak_seq, peak_pos = first_positions(ad == np.repeat(seq_max, lens), cu)
    peak: list[int | None] = [None] * len(lens)
    for s, p in zip(peak_seq, peak_pos, strict=True):
        peak[int(s)] = int(p)
    mean = _segment_mean(np.where(np.isnan(d), 0.0, d), ~np.isnan(d), cu)
    return [
        ReplayRecord(
            request_id=str(rid),
            index=int(indices[i]) if indices is not None else i,
            length=int(lens[i]),
            max_abs_diff=float(seq_max[i]),
            max_abs_diff_train=None if train_max is None else float(train_max[i]),
            first_divergence=first[i],
            max_position=peak[i],
            mean_diff=float(mean[i]),
            nonfinite=bool(nonfinite[i]),
        )
        for i, rid in enumerate(request_ids)
    ]


def _segment_mean(x: np.ndarray, counted: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """(N,) mean of `x` over the `counted` tokens of each sequence (0 where none counts)."""
    nonempty = np.diff(cu) > 0
    sums = np.zeros(nonempty.shape[0])
    counts = np.zeros(nonempty.shape[0])
    sums[nonempty] = np.add.reduceat(np.where(counted, x, 0.0), cu[:-1][nonempty])
    counts[nonempty] = np.add.reduceat(counted.astype(np.float64), cu[:-1][nonempty])
    return sums / np.maximum(counts, 1.0)


def rank(records: Sequence[ReplayRecord]) -> list[ReplayRecord]:
    """Worst first: non-finite, then by max |d| vs the engine; ties keep dump order."""
    return sorted(records, key=lambda r: (-r.score, r.index))


def context_window(
    prompt: Sequence[int], response: Sequence[int], position: int, width: int = CONTEXT_TOKENS
) -> tuple[list[int], int, list[int]]:
    """(up to `width` ids before, the id at response `position`, up to `width` ids after); the ids
    before reach back into the prompt when the position is near the start of the response."""
    if not 0 <= position < len(response):
        raise IndexError(f"position {position} outside a response of {len(response)} tokens")
    ids = [int(t) for t in prompt] + [int(t) for t in response]
    at = len(prompt) + position
    return ids[max(0, at - width) : at], ids[at], ids[at + 1 : at + 1 + width]


def with_context(
    record: ReplayRecord,
    prompt: Sequence[int],
    response: Sequence[int],
    logp_reference: np.ndarray,
    logp_rollout: np.ndarray,
    decode: Callable[[list[int]], str],
    width: int = CONTEXT_TOKENS,
) -> ReplayRecord:
    """`record` with the decoded window around its first divergence (unchanged if it has none)."""
    pos = record.first_divergence
    if pos is None:
        return record
    before, token, after = context_window(prompt, response, pos, width)
    ctx = Context(
        position=pos,
        token_id=token,
        token=decode([token]),
        before=decode(before) if before else "",
        after=decode(after) if after else "",
        logp_rollout=float(logp_rollout[pos]),
        logp_reference=float(logp_reference[pos]),
    )
    return replace(record, context=ctx)


def printable(text: str) -> str:
    """`text` on one line: newlines, tabs and other control characters escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
