"""Robust z (a sudden spike against the rolling median/MAD) and drift (one-sided CUSUM of slow growth).

Both watch upward moves only: a mismatch that shrinks is good news. Each keeps one
`RollingBaseline` per watched metric and stays silent for `warmup` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.detect.base import SEVERITIES, Alarm, Detector
from rlcheck.core.detect.rolling import RollingBaseline
from rlcheck.errors import ConfigError

WATCHED = (K.ABS_DIFF_CLIPPED_MEAN, K.ABS_DIFF_P99)
"""Robust to tail tokens: mean |d| clipped at StatsConfig.clip, and a quantile. (kl_k3 and the raw
mean |d| were watched before: one bf16 tail token at |d| = 8 moves kl_k3 by e^8 / tokens.)"""


@dataclass(frozen=True)
class RobustZConfig:
    metrics: tuple[str, ...] = WATCHED
    """Metrics scored against their own rolling median/MAD."""
    window: int = 128
    """Steps in the rolling baseline."""
    warmup: int = 32
    """Steps of history before the detector may fire."""
    z_threshold: float = 20.0
    """Robust z above which a step is a spike. High on purpose: step metrics are heavy-tailed (10,000
    clean Student-t-5 steps reach z ~ 15), and the periodic detector catches recurring spikes far
    below this."""
    severity: str = "warn"

    def __post_init__(self) -> None:
        if self.window < 8 or not 1 <= self.warmup <= self.window:
            raise ConfigError(f"need window >= 8 and 1 <= warmup <= window, got {self.window}, {self.warmup}")
        if self.z_threshold <= 0:
            raise ConfigError(f"z_threshold must be positive, got {self.z_threshold}")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity must be one of {SEVERITIES}")


class RobustZDetector(Detector):
    kind = "robust_z"

    def __init__(self, cfg: RobustZConfig | None = None):
        self.cfg = cfg or RobustZConfig()
        self.base = {m: RollingBaseline(self.cfg.window) for m in self.cfg.metrics}

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        alarms = []
        for m, base in self.base.items():
            x = metrics.get(m)
            if x is None:
                continue
            if len(base) >= self.cfg.warmup:
                med, scale = base.center_scale()
                z = (x - med) / scale
                if z > self.cfg.z_threshold:
                    alarms.append(Alarm(
                        self.kind, m, step, self.cfg.severity,
                        f"{m} spiked to {x:.4g} (robust z {z:.1f} over median {med:.4g})",
                        {"value": x, "z": z, "median": med, "scale": scale},
                    ))
            base.push(x)
        return alarms

    def state_dict(self) -> dict[str, Any]:
        return {m: b.state_dict() for m, b in self.base.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for m, values in state.items():
            if m in self.base:
                self.base[m].load_state_dict(values)


@dataclass(frozen=True)
class DriftConfig:
    metrics: tuple[str, ...] = (K.ABS_DIFF_CLIPPED_MEAN,)
    """Metrics watched for growth (the clipped mean |d|: one tail token cannot start a drift)."""
    window: int = 256
    """Steps in the rolling reference (its median)."""
    warmup: int = 64
    slack: float = math.log(1.5)
    """Growth ignored, as log(value / reference): 1.5x. A healthy bf16 run's floor grows ~10x over
    2,000 steps, which puts the newest step ~1.16x above a 256-step median; its step-to-step wobble
    (AR(1) in log space, stationary std ~0.12) adds the rest (BENCHMARKS.md, "Field fidelity")."""
    threshold: float = 3.0
    """CUSUM decision level: log-growth past the slack, accumulated (nats)."""
    clip: float = 1.0
    """Each step adds at most this (an e-fold): one outlier step is not a drift. A step below the
    reference counts as at most `slack` below it (it takes off at most 2 x slack): one low step (a
    batch of short answers at 0.05x) does not undo a drift under way."""
    critical_ratio: float = 3.0
    """A drift alarm whose value is this many times the reference is critical (it halts): weights
    that stopped syncing triple the mismatch within a few steps; the healthy floor never does."""
    severity: str = "warn"
    """Severity of a drift alarm below critical_ratio."""
    floor: float = 0.0
    """Values under it count as it (in the value and the reference): growth among levels this small is
    noise of a precise run (a float32 engine's |d| of 1e-7 doubling), not a drift. Set at the bf16 floor;
    it scales with the run's (`Detector.scale`)."""

    def __post_init__(self) -> None:
        if self.floor < 0:
            raise ConfigError(f"drift floor must be >= 0, got {self.floor}")
        if self.window < 8 or not 1 <= self.warmup <= self.window:
            raise ConfigError(f"need window >= 8 and 1 <= warmup <= window, got {self.window}, {self.warmup}")
        if self.threshold <= 0 or self.slack < 0 or self.clip <= self.slack or self.critical_ratio <= 1:
            raise ConfigError("need threshold > 0, slack >= 0, clip > slack and critical_ratio > 1")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity must be one of {SEVERITIES}")


CONTROL_DRIFT = DriftConfig(metrics=(K.PROBE_LEVEL,), window=32, warmup=16, slack=0.1, threshold=0.5,
                            clip=0.5, critical_ratio=2.0, floor=1e-3)
"""Fast drift of the sync check's probe batch (`DetectorsConfig.control_drift`). Its tokens are fixed,
so its level carries no step wobble from what the policy samples (the field streams' AR(1) wobble,
std 0.15 in log, is what holds the main drift detector to a 1.5x slack); what is left is bf16 noise
on 4,096 tokens (~5%) and the floor's own growth (10x over 1,500 observations puts the newest ~1.02x
above a 32-step median). A 1.1x slack and a 0.5 nat threshold warn within 7-9 steps of a 3.3x rise
over 30 steps; critical (it halts) at 2x the reference: the engine alone doubled. Set on the
calibration seeds (BENCHMARKS.md, "Detector power on new shapes"). Levels under 1e-3 nats (`floor`:
a float32 engine's probe sits at 1e-7 to 1e-5) do not drift."""
RESIDUAL_TREND = DriftConfig(metrics=(K.RESIDUAL_LEVEL,), window=256, warmup=64, slack=0.3, threshold=2.0,
                              clip=1.0, critical_ratio=3.0, floor=1e-2)
"""Drift of the step's residual level (`rlcheck.core.stats.residual`: the mean |d| with the token mix
out), the drift a run without a probe can see (`DetectorsConfig.residual_trend`): responses growing
longer and less peaked do not move it, an engine drifting does. Set on the calibration seeds of the
field streams (BENCHMARKS.md, "Slow drifts without a probe"): a 5x rise over 450 steps warns at
1.54-1.8x, a 3.3x rise over 30 steps 13-19 steps in, and no healthy scenario warns (gapped, bf16-short,
two-ranks, bf16-long-cot, 3 x long-cot-growing). Their step-to-step wobble (AR(1), std 0.16 in log) is
the residual's too, and the healthy floor itself grows 10x over 2,000 steps (on the gapped stream 10x
over 1,000 observations, a third of the slow drift's rate): a lower slack or level warns on healthy
streams (the sync check's probe has no wobble: `CONTROL_DRIFT`). Even an oracle that knows the wobble's
AR structure and the ramp, onset aside, needs a median 14-18 steps for the 3.3x rise at no false alarm
(`benchmarks/bench_drift_bound.py`): 13-19 is at that bound. Levels under 1e-2 (bf16 residual units; a healthy
bf16 run's ~0.06) do not drift."""
CONTROL_TREND = DriftConfig(metrics=(K.PROBE_LEVEL,), window=256, warmup=64, slack=0.3, threshold=0.8,
                            clip=0.5, critical_ratio=2.0, floor=1e-3)
"""Slow drift of the probe (`DetectorsConfig.control_trend`): a 32-step reference follows a 5x rise
over 450 steps (1.06x a window), a 256-step one does not; the healthy floor's growth puts the newest
step up to 1.2x above its median, hence the 1.35x slack. Warns at 1.56-1.61x of such a rise."""


class DriftDetector(Detector):
    """Per metric, with g = log(x / median of the window):
    S = max(0, S + clip(g, -slack, clip) - slack); alarm and reset when S > threshold."""

    kind = "drift"

    def __init__(self, cfg: DriftConfig | None = None):
        self.cfg = cfg or DriftConfig()
        self.base = {m: RollingBaseline(self.cfg.window) for m in self.cfg.metrics}
        self.cusum = {m: 0.0 for m in self.cfg.metrics}
        self.since = {m: -1 for m in self.cfg.metrics}  # step the current excursion began

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        cfg, alarms = self.cfg, []
        for m, base in self.base.items():
            x = metrics.get(m)
            if x is None:
                continue
            if len(base) >= cfg.warmup:
                med, _ = base.center_scale()
                floor = max(cfg.floor * self.scale, _TINY)
                g = min(max(math.log(max(x, floor) / max(med, floor)), -cfg.slack), cfg.clip)
                s = max(0.0, self.cusum[m] + g - cfg.slack)
                if s > 0 and self.cusum[m] == 0:
                    self.since[m] = step
                self.cusum[m] = s
                if s > cfg.threshold:
                    alarms.append(self._alarm(m, step, x, med, s))
                    self.cusum[m] = 0.0
            base.push(x)
        return alarms

    def _alarm(self, m: str, step: int, x: float, med: float, s: float) -> Alarm:
        ratio = x / max(med, self.cfg.floor * self.scale, _TINY)
        severity = "critical" if ratio >= self.cfg.critical_ratio else self.cfg.severity
        return Alarm(
            self.kind, m, step, severity,
            f"{m} has been drifting up since step {self.since[m]} (now {x:.4g}, {ratio:.1f}x the "
            f"reference {med:.4g})",
            {"value": x, "reference": med, "ratio": ratio, "cusum": s, "since_step": self.since[m]},
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "base": {m: b.state_dict() for m, b in self.base.items()},
            "cusum": dict(self.cusum),
            "since": dict(self.since),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for m, values in state.get("base", {}).items():
            if m in self.base:
                self.base[m].load_state_dict(values)
        self.cusum.update({m: float(v) for m, v in state.get("cusum", {}).items() if m in self.cusum})
        self.since.update({m: int(v) for m, v in state.get("since", {}).items() if m in self.since})


_TINY = 1e-12  # a metric at exactly 0 (an exact match) has no log; growth from it is counted from here
