"""`Tally`: the sums, maxima and minima a metric is finalized from, kept apart so that the parts of one
step held by several ranks combine exactly (sums add, maxima take the max, minima the min) before any
division: never an average of per-rank means. The correction (`rlcheck.core.correction`) and the MoE
routing agreement (`rlcheck.core.moe`) are tallied this way; `rlcheck.distributed` merges the ranks'."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Tally:
    """Named partial reductions of one batch (plain floats: it travels between ranks as data)."""

    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)

    def add(self, other: Tally) -> Tally:
        """This tally and `other` combined in place (a key one of them lacks is the other's)."""
        for key, value in other.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        for key, value in other.maxima.items():
            self.maxima[key] = max(self.maxima.get(key, -math.inf), value)
        for key, value in other.minima.items():
            self.minima[key] = min(self.minima.get(key, math.inf), value)
        return self

    @classmethod
    def merge(cls, parts: Iterable[Tally | None]) -> Tally:
        """One tally of several parts (None: a part with nothing to tally)."""
        out = cls()
        for part in parts:
            if part is not None:
                out.add(part)
        return out

    def __bool__(self) -> bool:
        return bool(self.sums or self.maxima or self.minima)
