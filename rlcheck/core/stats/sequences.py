"""Per-sequence reductions (segment reductions over cu_seqlens, no loop over sequences) and offenders."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rlcheck.core import histogram as H
from rlcheck.core.batch import segment_token_indices
from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.types import Offender, rank_offenders


def segment_max(x: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """(N,) float64 maximum of `x` (M,) over each sequence of `cu` (N+1,); 0 for empty sequences."""
    lens = np.diff(cu)
    nonempty = lens > 0
    out = np.zeros(lens.shape[0], dtype=np.float64)
    out[nonempty] = np.maximum.reduceat(x, cu[:-1][nonempty])
    return out


def segment_count(flags: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """(N,) int64 number of True in `flags` (M,) over each sequence of `cu` (N+1,); 0 for empty ones."""
    lens = np.diff(cu)
    nonempty = lens > 0
    out = np.zeros(lens.shape[0], dtype=np.int64)
    out[nonempty] = np.add.reduceat(flags, cu[:-1][nonempty], dtype=np.int64)
    return out


def first_positions(flags: np.ndarray, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sequences, positions): every sequence of `cu` holding a True in `flags` (M,), ascending, and
    the position of its first True counted from the sequence start."""
    return first_in_segments(np.flatnonzero(flags), cu)


def first_in_segments(pos: np.ndarray, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`first_positions` from the flagged token indices `pos` (F,), ascending: int64 throughout."""
    pos = np.asarray(pos, dtype=np.int64)
    seq_of = np.searchsorted(cu, pos, side="right") - 1
    seqs, first_idx = np.unique(seq_of, return_index=True)
    return seqs, pos[first_idx] - cu[seqs]


def divergence(d: np.ndarray, cu: np.ndarray, tau: float) -> tuple[np.ndarray, list[int | None]]:
    """Per sequence of `cu` (N+1,): (N,) float64 max |d| over the finite tokens of `d` (M,), and the
    first position with |d| > tau or a non-finite d (None where there is none)."""
    bad = ~np.isfinite(d)
    ad = np.where(bad, 0.0, np.abs(d))
    first: list[int | None] = [None] * (cu.shape[0] - 1)
    for s, p in zip(*first_positions((ad > tau) | bad, cu), strict=True):
        first[int(s)] = int(p)
    return segment_max(ad, cu), first


def packed(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(M,) float64 concatenation of per-sequence arrays and their (N+1,) int64 boundaries."""
    cu = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=cu[1:])
    flat = np.concatenate(arrays).astype(np.float64) if arrays else np.zeros(0)
    return flat, cu


def log_diff(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """(M,) reference - other, NaN where either side is non-finite or a sentinel (< MIN_LOGPROB)."""
    d = reference - other
    bad = ~np.isfinite(d) | (reference < MIN_LOGPROB) | (other < MIN_LOGPROB)
    return np.where(bad, np.nan, d)


def request_divergence(reference: Sequence[np.ndarray], other: Sequence[np.ndarray],
                       tau: float) -> tuple[np.ndarray, list[int | None]]:
    """Per request (one (L_i,) array a side): (N,) max |reference - other|, inf where a token is
    non-finite or a sentinel on either side, and the first token over `tau` (or non-finite)."""
    ref, cu = packed(list(reference))
    d = log_diff(ref, packed(list(other))[0])  # (M,)
    seq_max, first = divergence(d, cu, tau)
    nonfinite = segment_max(np.isnan(d).astype(np.float64), cu) > 0
    return np.where(nonfinite, np.inf, seq_max), first


def catastrophic_sequences(ad: np.ndarray, cu: np.ndarray, counts: np.ndarray, cfg) -> np.ndarray:
    """(N,) bool: sequences with at least `catastrophic_min_frac` of their `counts` (N,) valid tokens,
    and `catastrophic_min_tokens` tokens, at |d| >= catastrophic_tau (`ad` (M,), 0 where invalid); or
    which diverge (|d| > divergence_tau) within their first `early_window` tokens and, within their
    first `early_span` tokens, hold `catastrophic_min_tokens` tokens past divergence_tau and one at
    catastrophic_tau: a stale recurrent state garbles the first tokens of a response (the engine's
    stale-state fault on the tiny hybrid: first divergence at token 0, max |d| 1.4-3.7, one token of
    32 past 2 nats), while a healthy tail token is one token, anywhere."""
    rate, early = catastrophic_parts(ad, cu, counts, cfg)
    return rate | early


def catastrophic_parts(ad: np.ndarray, cu: np.ndarray, counts: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """The two clauses of `catastrophic_sequences`, (N,) bool each: (the rate, the early divergence).
    The early clause counts its tokens past divergence_tau and catastrophic_tau within the sequence's
    first `early_span` tokens only, where a stale state garbles it."""
    over = segment_count(ad >= cfg.catastrophic_tau, cu)  # (N,)
    rate = (over >= cfg.catastrophic_min_tokens) & (over >= cfg.catastrophic_min_frac * counts)
    seqs, pos = first_positions(ad > cfg.divergence_tau, cu)
    cand = seqs[pos < cfg.early_window]  # (C,) sequences that diverge within their first tokens
    early = np.zeros(cu.shape[0] - 1, dtype=bool)
    if cand.size:
        starts = cu[cand]
        lens = np.minimum(cu[cand + 1] - starts, cfg.early_span)
        tok = segment_token_indices(starts, lens)  # their leading tokens
        head = np.zeros(cand.size + 1, dtype=np.int64)
        np.cumsum(lens, out=head[1:])
        head_ad = ad[tok]
        early[cand] = ((segment_count(head_ad >= cfg.catastrophic_tau, head) > 0)
                       & (segment_count(head_ad > cfg.divergence_tau, head) >= cfg.catastrophic_min_tokens))
    return rate, early


def sequence_stats(batch, cfg, d, ad, valid, nonfinite, sums, maxima, minima, hists) -> tuple[Offender, ...]:
    """Per-sequence reductions (into the dicts) and the top-K offenders."""
    cu = batch.cu_seqlens  # (N+1,) int64
    lens = np.diff(cu)  # (N,)
    num = lens.shape[0]
    nonempty = lens > 0
    starts = cu[:-1][nonempty]
    seq_max = segment_max(ad, cu)
    seq_sum = np.zeros(num, dtype=np.float64)
    seq_sum[nonempty] = np.add.reduceat(d, starts, dtype=np.float64)
    if valid is None:
        counts = lens
    else:
        counts = np.zeros(num, dtype=np.int64)
        counts[nonempty] = np.add.reduceat(valid, starts, dtype=np.int64)
    seq_bad = np.zeros(num, dtype=bool)  # holds a non-finite token
    if nonfinite is not None:
        seq_bad[nonempty] = np.logical_or.reduceat(nonfinite, starts)
    counted = counts > 0
    seq_mean = seq_sum / np.maximum(counts, 1)

    diverged = ad > cfg.divergence_tau
    if nonfinite is not None:
        diverged |= nonfinite
    div_seq, div_pos = first_positions(diverged, cu)  # (D,) each: diverged sequences, first positions
    first_div = np.full(num, -1, dtype=np.int64)  # internal only; Offender uses None
    first_div[div_seq] = div_pos

    catastrophic = catastrophic_sequences(ad, cu, counts, cfg) | seq_bad
    early = catastrophic & (first_div >= 0) & (first_div < cfg.early_window)
    sums.update(
        seq_total=float(num),
        seq_n=float(np.count_nonzero(counted)),
        seq_empty=float(num - np.count_nonzero(counted)),
        seq_max=float(seq_max[counted].sum()),
        seq_logratio=float(seq_sum[counted].sum()),
        seq_lppl=float(seq_mean[counted].sum()),
        seq_flagged=float(np.count_nonzero((seq_max > cfg.divergence_tau) | seq_bad)),
        seq_cat=float(np.count_nonzero(catastrophic)),
        early_div=float(np.count_nonzero(early)),
        early_any=float(np.count_nonzero((first_div >= 0) & (first_div < cfg.early_window))),
        early_slots=float(np.minimum(counts, cfg.early_window).sum()),
        div_tokens=float(np.count_nonzero(diverged if valid is None else diverged & valid)),
    )
    maxima.update(
        seq_logratio=float(np.abs(seq_sum[counted]).max(initial=0.0)),
        seq_lppl=float(np.abs(seq_mean[counted]).max(initial=0.0)),
    )
    minima["first_div"] = float(div_pos.min()) if div_pos.size else math.inf
    hists["first_div"] = H.position_histogram(div_pos)

    score = np.where(seq_bad, np.inf, seq_max)
    k = min(cfg.top_k, num)
    top = np.argsort(-score, kind="stable")[:k]  # ties go to the lower index, as in merge()
    return rank_offenders(
        [
            Offender(
                request_id=batch.request_ids[i],
                index=int(i),
                max_abs_diff=float(seq_max[i]),
                first_divergence=int(first_div[i]) if first_div[i] >= 0 else None,
                length=int(lens[i]),
                mean_diff=float(seq_mean[i]),
                nonfinite=bool(seq_bad[i]),
            )
            for i in top
        ],
        k,
    )
