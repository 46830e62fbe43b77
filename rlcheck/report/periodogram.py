"""The periodic detector's view of a run: its fold score C(P) for every period P, at one step.

The series is replayed through a `PeriodicDetector` (`rlcheck.core.detect.periodic`) to rebuild the exact
z-score history it held at that step: the step of the first periodic alarm on the metric, else the
run's last step. Only the last `window + history` steps are replayed (the rolling baseline and the
z history are both bounded), so a 100k-step run costs the same as a short one. The scores are the
detector's own folds (`passing_folds`) under a config that lets every fold through: the largest
C(P, k) over the fold sizes k is the bar of period P. A fold none of whose occurrences is raised
scores 0 here, as does a negative score. The detected period is the alarm's, so the mark on the
plot is what the live detector decided.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rlcheck.core.detect.periodic import PeriodicConfig, PeriodicDetector

_ANY = 1e-12  # a threshold and a hit fraction that every scored fold passes


@dataclasses.dataclass(frozen=True)
class Periodogram:
    metric: str
    step: int
    """The step whose history was folded."""
    periods: np.ndarray
    """(P,) int64: min_period up to the longest period the history could test (at most max_period)."""
    scores: np.ndarray
    """(P,) float64: best fold score C(P, k) over k; 0 where no fold scored above 0."""
    threshold: float
    """The detector's decision level for C."""
    period: int | None = None
    """Detected period (from the periodic alarm), None when the detector raised none."""
    phase: int | None = None
    message: str = ""
    """The alarm's message ("" when none)."""
    history: int = 0
    """z-scores the detector held at `step`."""


def watched_metrics(state: dict[str, Any] | None, cfg: PeriodicConfig) -> tuple[str, ...]:
    """Metrics the run's periodic detector watched: the keys of its saved `state` (the run's
    state.json, `Run.state()`), else `cfg.metrics`."""
    try:
        watched = tuple(state["detectors"]["periodic"])  # type: ignore[index]
    except (KeyError, TypeError):
        return cfg.metrics
    return watched or cfg.metrics


def replay_z(steps: np.ndarray, values: np.ndarray, metric: str, at: int, cfg: PeriodicConfig) -> np.ndarray:
    """(H,) the detector's clipped z-scores of `metric` up to and including step `at`, oldest first,
    on its grid of steps (NaN where a step of the grid was not observed).

    steps, values: (S,) the run's steps (ascending) and the metric's values (NaN where not logged)."""
    det = PeriodicDetector(dataclasses.replace(cfg, metrics=(metric,), trigger=math.inf))  # never folds here
    end = int(np.searchsorted(steps, at, side="right"))
    start = max(0, end - cfg.history - cfg.window)
    for step, x in zip(steps[start:end].tolist(), values[start:end].tolist(), strict=True):
        if math.isfinite(x):
            det.update(step, {metric: x})
    return det.grid(metric)[0]


def longest_testable(num_z: int, cfg: PeriodicConfig) -> int:
    """The longest period whose shortest fold fits in `num_z` z-scores (capped at max_period)."""
    return min(cfg.max_period, num_z // min(cfg.folds)) if num_z >= cfg.min_other else 0


def fold_scores(z: np.ndarray, cfg: PeriodicConfig) -> np.ndarray:
    """(max_period - min_period + 1,) best C(P, k) over k of the fold ending at z[-1], 0 when none."""
    relaxed = PeriodicDetector(dataclasses.replace(cfg, threshold=_ANY, min_hit_frac=_ANY, harmonic_gap=math.inf))
    scores = np.zeros(cfg.max_period - cfg.min_period + 1)
    for period, _k, score, _hits in relaxed.passing_folds(z[::-1]):
        i = period - cfg.min_period
        scores[i] = max(scores[i], score)
    return scores


def periodogram(steps: np.ndarray, values: np.ndarray, metric: str, alarms: list[dict[str, Any]],
                cfg: PeriodicConfig | None = None) -> Periodogram | None:
    """The periodogram of `metric` at its first periodic alarm (else at the last step); None when the
    detector had not warmed up by then (too few steps to fold)."""
    cfg = cfg or PeriodicConfig()
    if steps.size == 0:
        return None
    alarm = next((a for a in alarms if a.get("kind") == "periodic" and a.get("metric") == metric), None)
    at = int(alarm["step"]) if alarm else int(steps[-1])
    z = replay_z(steps, values, metric, at, cfg)
    longest = longest_testable(z.size, cfg)
    if longest < cfg.min_period:
        return None
    details = (alarm or {}).get("details") or {}
    period, phase = details.get("period"), details.get("phase")
    return Periodogram(
        metric, at, np.arange(cfg.min_period, longest + 1), fold_scores(z, cfg)[: longest - cfg.min_period + 1],
        cfg.threshold, int(period) if period is not None else None, int(phase) if phase is not None else None,
        str((alarm or {}).get("message", "")), int(z.size),
    )
