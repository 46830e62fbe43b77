"""Accurate sums of large float32 arrays without a float64 copy."""

from __future__ import annotations

import numpy as np

_BLOCK = 4096


def sum64(x: np.ndarray) -> float:
    """Sum of a float array accurate to float64 without a float64 copy: float32 block sums (numpy's
    pairwise summation inside each block) are added in float64."""
    if x.dtype != np.float32 or x.shape[0] < 2 * _BLOCK:
        return float(np.add.reduce(x, dtype=np.float64))
    n = x.shape[0] // _BLOCK * _BLOCK
    rows = x[:n].reshape(-1, _BLOCK).sum(axis=1)  # (M/B,) float32
    return float(rows.sum(dtype=np.float64) + np.add.reduce(x[n:], dtype=np.float64))


def sum_product(a: np.ndarray, b: np.ndarray, scratch: np.ndarray) -> float:
    """sum(a * b) through a reused scratch buffer."""
    np.multiply(a, b, out=scratch)
    return sum64(scratch)
