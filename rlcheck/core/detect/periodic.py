"""Periodic detector: spikes that recur every P steps at a fixed phase, even when each one is small.

Each step's value becomes a robust z-score against the rolling median/MAD (clipped, so one outlier
weighs little). When the current step is itself raised (z >= `trigger`), every period P is tested
by folding the history: the k most recent steps at the same phase (t, t-P, ..., t-(k-1)P) against
the other phases over the same span,

    C(P, k) = (sum_i z[t - iP] - k * mean(z at other phases)) / sqrt(k + k^2 / n_other)

scaled by the spread of the other-phase z-scores over at least `min_var_span` steps (never below 1),
so heavy-tailed noise does not pass for evidence. It is a standard normal score when nothing is
periodic, and ~0 for a level shift or a trend, which raise every phase alike. The period with the largest C >= `threshold`, whose fold is mostly raised
(at least `min_hit_frac` of its k values above `hit_z`), is reported with its phase, the number of
spikes seen and the next step expected to spike.

Step numbers may have gaps: TRL observes every `num_iterations`-th optimizer step (0, 2, 4, ...),
a resumed run skips or repeats steps. The z-scores are laid on a grid of the steps' common stride
(the gcd of the gaps between the steps held), a step never observed is a hole that no sum counts,
so a period is found in steps whatever the stride; the alarm names it in steps and in observations.
A step at or before the last one (a trainer resumed from an earlier checkpoint) drops the history
from that step on, z-scores and the rolling baseline's values alike: it belonged to a timeline the
run abandoned.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.detect.base import SEVERITIES, Alarm, Detector
from rlcheck.core.detect.folds import passing_folds
from rlcheck.core.detect.rolling import RollingBaseline
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class PeriodicConfig:
    metrics: tuple[str, ...] = (K.ABS_DIFF_CLIPPED_MEAN, K.SEQ_LEVEL_SPREAD)
    """Metrics searched for periodic spikes: the clipped mean |d| (a bf16 tail token is no spike) and
    the spread of the sequences' levels (`rlcheck.core.stats.levels`: a fault on part of the batch,
    which the step's wobble hides in the mean; logged by `Monitor.observe`)."""
    min_period: int = 2
    max_period: int = 50
    """Periods searched, in steps of the grid (the steps' stride: observations when it is regular)."""
    folds: tuple[int, ...] = (5, 6, 8, 11, 16)
    """Numbers of recent occurrences k tested per period."""
    window: int = 128
    """Steps in the rolling baseline that turns values into z-scores."""
    warmup: int = 32
    clip: float = 3.5
    """z-scores are clipped to [-clip, clip] before folding (the fold's own occurrences to
    [-clip * s, clip * s], s the other phases' spread, at least 1)."""
    trigger: float = 1.0
    """Only a step with z >= trigger is tested (a periodic alarm fires on a spike)."""
    hit_z: float = 1.0
    """An occurrence is raised when it exceeds the other phases' mean by hit_z * s."""
    min_hit_frac: float = 0.85
    """At least this fraction of a fold's k values must exceed the other-phase mean by hit_z: the
    whole fold is raised, not a couple of outliers (all of k <= 6, all but one of k = 8 or 11)."""
    threshold: float = 6.0
    """Decision level for C. Over 84 clean 10,000-step series (Gaussian, Student-t 5, Gaussian with
    2% of steps 8x wider) the largest C that passed the other tests was 5.9; at 5.6, 7% of those
    series would have raised a false alarm."""
    min_other: int = 16
    """The other-phase reference spans at least this many steps (matters for small P)."""
    min_var_span: int = 64
    """The other-phase spread is measured over at least this many steps."""
    harmonic_gap: float = 2.0
    """A fold whose even occurrences beat its odd ones by more than this (mean z) is half the period."""
    severity: str = "warn"
    """Severity of a fold that passes these tests but not the critical ones."""
    critical_clip: float = 4.0
    critical_hit_z: float = 2.0
    critical_threshold: float = 6.5
    """A fold that passes with these in place of clip, hit_z and threshold is critical (it halts: a
    periodic mismatch is a systematic fault, a skipped sync or a wrapping index). Two tiers because
    on the field streams five same-phase steps at 1.2-2.5x a healthy floor lined up by chance once
    in 3,000 observations (calibration seed 0 of bf16-short, C between 6.0 and 6.5): at the lenient
    tier that is one warning, while halting asks each occurrence to stand 2 spreads out; 2x spikes
    every 12 steps still halt within 3-4 periods (BENCHMARKS.md, "Field fidelity")."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_period <= self.max_period:
            raise ConfigError(f"need 2 <= min_period <= max_period, got {self.min_period}, {self.max_period}")
        if not self.folds or min(self.folds) < 2:
            raise ConfigError(f"folds must be integers >= 2, got {self.folds}")
        if self.window < 8 or not 1 <= self.warmup <= self.window:
            raise ConfigError(f"need window >= 8 and 1 <= warmup <= window, got {self.window}, {self.warmup}")
        if not 0 < self.min_hit_frac <= 1 or self.threshold <= 0 or self.clip <= 0:
            raise ConfigError("need 0 < min_hit_frac <= 1, threshold > 0 and clip > 0")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity must be one of {SEVERITIES}")
        if not (self.critical_clip > 0 and self.critical_threshold > 0 and self.critical_hit_z >= 0):
            raise ConfigError("need critical_clip > 0, critical_threshold > 0 and critical_hit_z >= 0")

    @property
    def history(self) -> int:
        """z-scores kept: enough for the longest fold of the longest period."""
        return max(self.max_period * max(self.folds), self.min_other, self.min_var_span) + 1


class PeriodicDetector(Detector):
    kind = "periodic"

    def __init__(self, cfg: PeriodicConfig | None = None):
        self.cfg = cfg or PeriodicConfig()
        self.critical_cfg = dataclasses.replace(self.cfg, clip=self.cfg.critical_clip, hit_z=self.cfg.critical_hit_z,
                                                threshold=self.cfg.critical_threshold)
        self.base = {m: RollingBaseline(self.cfg.window) for m in self.cfg.metrics}
        self.z = {m: deque(maxlen=self.cfg.history) for m in self.cfg.metrics}  # clipped z, oldest first
        self.steps = {m: deque(maxlen=self.cfg.history) for m in self.cfg.metrics}  # their step numbers
        self.base_steps = {m: deque(maxlen=self.cfg.window) for m in self.cfg.metrics}  # the baseline values' steps

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        alarms = []
        for m, base in self.base.items():
            x = metrics.get(m)
            if x is None:
                continue
            self._rewind(m, step)
            if len(base) >= self.cfg.warmup:
                z = max(min(base.zscore(x), _HELD_CLIP * self.cfg.clip), -_HELD_CLIP * self.cfg.clip)
                self._push(m, step, z)
                if z >= self.cfg.trigger:
                    rz, stride = self.grid(m)
                    found = self._best_period(rz)
                    if found is not None:
                        alarms.append(self._alarm(m, step, x, stride, rz, found[1], *found[0]))
            base.push(x)
            self.base_steps[m].append(step)
        return alarms

    def _rewind(self, m: str, step: int) -> None:
        """Forget the z-scores and baseline values of steps at or after `step` (a resumed trainer
        repeats them)."""
        steps, z, base, base_steps = self.steps[m], self.z[m], self.base[m], self.base_steps[m]
        while steps and steps[-1] >= step:
            steps.pop()
            z.pop()
        while base_steps and base_steps[-1] >= step:
            base_steps.pop()
            base.pop()

    def _push(self, m: str, step: int, z: float) -> None:
        steps, zs = self.steps[m], self.z[m]
        steps.append(step)
        zs.append(z)
        while steps[-1] - steps[0] > self.cfg.history * _stride(steps):  # a long gap: older z off the grid
            steps.popleft()
            zs.popleft()

    def grid(self, m: str) -> tuple[np.ndarray, int]:
        """((G,) the z-scores of `m` on the grid of the held steps' stride, oldest first, NaN where a
        step was not observed; the stride in steps)."""
        steps = np.fromiter(self.steps[m], dtype=np.int64)
        stride = _stride(self.steps[m])
        if steps.size == 0:
            return np.zeros(0), stride
        pos = (steps - steps[0]) // stride
        out = np.full(int(pos[-1]) + 1, np.nan)
        out[pos] = np.fromiter(self.z[m], dtype=np.float64)
        return out, stride

    def _best_period(self, z: np.ndarray) -> tuple[tuple[int, int, float, int], str] | None:
        """(fold, severity): the critical tier's best fold, else the lenient one's, else None."""
        strict = self._best_fold(self.passing_folds(z[::-1], self.critical_cfg))
        if strict is not None:
            return strict, "critical"
        lenient = self._best_fold(self.passing_folds(z[::-1]))
        return (lenient, self.cfg.severity) if lenient is not None else None

    @staticmethod
    def _best_fold(passing: list[tuple[int, int, float, int]]) -> tuple[int, int, float, int] | None:
        """(period, k, score, hits) of the fold ending at the newest z that explains it best, if any.

        Among the folds that pass, one whose alternate occurrences disagree (t, t-2P, ... raised but
        t-P, t-3P, ... not) is half the true period and is dropped; of the rest, the best score wins,
        and a divisor of its period that also passes is preferred (a spike every P steps also spikes
        every 2P steps)."""
        if not passing:
            return None
        best = max(passing, key=lambda c: c[2])
        for cand in sorted(passing):
            if best[0] % cand[0] == 0:
                return cand if cand[0] < best[0] else best
        return best

    def passing_folds(self, rz: np.ndarray, cfg: PeriodicConfig | None = None) -> list[tuple[int, int, float, int]]:
        """Every (period, k, score, hits) whose fold passes; rz[0] is the current step, NaN marks a
        step of the grid never observed (it counts nowhere: k and the other-phase count are of the
        observed steps only). Public for the report's periodogram, which calls it under a config that
        lets every fold through.

        The other phases' mean and spread s come from z clipped at `clip`; the fold's own values are
        clipped at clip * s, so a series whose z-scores spread wider than the MAD promises
        (autocorrelated, heavy-tailed: s ~ 1.6 on the field streams) keeps the power of a unit-spread
        one, and a clean one (s ~ 1) is scored as before. `cfg`: the tier's (default: this one's)."""
        return passing_folds(rz, cfg or self.cfg)

    def _alarm(self, m: str, step: int, x: float, stride: int, rz: np.ndarray, severity: str,
               period: int, k: int, score: float, hits: int) -> Alarm:
        steps = period * stride
        observed = float(np.count_nonzero(~np.isnan(rz[-period:]))) if rz.size >= period else float(period)
        per_obs = f"{observed:g} observations" if observed != 1 else "1 observation"
        phase = step % steps
        return Alarm(
            self.kind, m, step, severity,
            f"{m} spikes every {steps} steps ({per_obs}; phase {phase}: steps = {phase} mod {steps}); "
            f"{hits} of the last {k} occurrences raised, next expected at step {step + steps}",
            {
                "period": steps,
                "period_observations": observed,
                "stride": stride,
                "phase": phase,
                "occurrences": hits,
                "folds": k,
                "score": score,
                "next_expected": step + steps,
                "value": x,
            },
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            m: {"base": self.base[m].state_dict(), "base_steps": list(self.base_steps[m]), "z": list(self.z[m]),
                "steps": list(self.steps[m])}
            for m in self.base
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for m, s in state.items():
            if m in self.base:
                self.base[m].load_state_dict(s["base"])
                z = [float(v) for v in s["z"]]
                # state.json of an earlier rlcheck held consecutive z-scores ending at last_step
                steps = s.get("steps") or list(range(int(s.get("last_step", -1)) - len(z) + 1, int(s.get("last_step", -1)) + 1))
                self.z[m].clear()
                self.z[m].extend(z)
                self.steps[m].clear()
                self.steps[m].extend(int(v) for v in steps)
                self.base_steps[m].clear()
                self.base_steps[m].extend(_base_steps(s, len(self.base[m]), steps))


def _base_steps(state: dict[str, Any], count: int, z_steps: list[int]) -> list[int]:
    """The steps of the `count` baseline values a saved state holds: as saved, or (a state.json of an
    earlier rlcheck) the newest z-scores' steps, which every observed step past the warm-up has, else
    consecutive steps ending at the newest."""
    saved = state.get("base_steps")
    if saved is not None and len(saved) == count:
        return [int(v) for v in saved]
    if len(z_steps) >= count:
        return [int(v) for v in z_steps[len(z_steps) - count:]] if count else []
    last = int(z_steps[-1]) if z_steps else count - 1
    return list(range(last - count + 1, last + 1))


_HELD_CLIP = 4.0
"""z-scores are held clipped at this many times `clip` (the folds clip them again, scaled by the
series' spread)."""


def _stride(steps) -> int:
    """The grid stride of the held steps: the gcd of the gaps between them (1 with fewer than two)."""
    if len(steps) < 2:
        return 1
    arr = np.fromiter(steps, dtype=np.int64)
    return max(int(np.gcd.reduce(np.diff(arr))), 1)
