"""Bounded rolling history with a robust baseline (median and MAD), shared by the detectors."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class RollingBaseline:
    """The last `window` values of one metric; `zscore(x)` scores x against them.

    The scale is floored at `rel_floor * |median|` and `abs_floor`, so a metric that sits perfectly
    still (an exact match, all zeros) does not turn every tiny wobble into an infinite z-score.
    """

    def __init__(self, window: int, rel_floor: float = 0.02, abs_floor: float = 1e-9):
        self.values: deque[float] = deque(maxlen=window)
        self.rel_floor = rel_floor
        self.abs_floor = abs_floor

    def __len__(self) -> int:
        return len(self.values)

    def push(self, x: float) -> None:
        self.values.append(float(x))

    def pop(self) -> float:
        """Take the newest value back out (a step the run abandoned)."""
        return self.values.pop()

    def center_scale(self) -> tuple[float, float]:
        w = np.fromiter(self.values, dtype=np.float64, count=len(self.values))
        med = float(np.median(w))
        mad = float(np.median(np.abs(w - med)))
        return med, max(MAD_TO_SIGMA * mad, self.rel_floor * abs(med), self.abs_floor)

    def zscore(self, x: float) -> float:
        med, scale = self.center_scale()
        return (x - med) / scale

    def state_dict(self) -> list[float]:
        return list(self.values)

    def load_state_dict(self, values: list[float]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in values if v is not None and math.isfinite(v))
