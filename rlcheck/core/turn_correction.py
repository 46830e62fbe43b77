"""Sequence-level importance weights of multi-turn episodes: the per-token mean, never the sum.

verl's sequence-level IS weight is exp(sum of d over the sequence). Over a long agent episode (thousands of
tokens, 40-60 turns) a healthy per-token mismatch sums to a weight far from 1 (NeMo-RL #2269: 0.06 at step
1 with every token ratio healthy; TRL #5815), and the weights collapse. On a batch with turns
(`StepBatch.turns`) rlcheck's sequence level is the geometric mean ratio, exp(mean d) over the sequence's
compared tokens: `episode_d` divides each token's d by that count, so that the sum the sequence level takes
is the mean. Token-level weights and single-turn batches are left as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def episode_d(batch: Any, d: np.ndarray, mask: np.ndarray, level: str | None) -> np.ndarray:
    """(M,) the `d` a correction of `level` sums per sequence: d / (the sequence's compared tokens) on a
    multi-turn batch at sequence level (its sum the per-token mean), else `d` itself."""
    if level != "sequence" or getattr(batch, "turns", None) is None:
        return d
    lens = np.diff(batch.cu_seqlens)
    seq = np.repeat(np.arange(lens.shape[0]), lens)  # (M,)
    counts = np.bincount(seq[mask], minlength=lens.shape[0]).astype(np.float64)  # (N,)
    return d / np.maximum(counts, 1.0)[seq]
