"""Robust z (a sudden spike against the rolling median/MAD) and drift (one-sided CUSUM of slow growth).

Both watch upward moves only: a mismatch that shrinks is good news. Each keeps one
`RollingBaseline` per watched metric and stays silent for `warmup` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck import metrics as K
from rlcheck.detect.base import SEVERITIES, Alarm, Detector
from rlcheck.detect.rolling import RollingBaseline
from rlcheck.errors import ConfigError

WATCHED = (K.ABS_DIFF_MEAN, K.KL_K3, K.ABS_DIFF_P99)


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
    metrics: tuple[str, ...] = (K.ABS_DIFF_MEAN, K.KL_K3)
    """Metrics watched for slow growth."""
    window: int = 256
    """Steps in the rolling reference."""
    warmup: int = 64
    slack: float = 0.5
    """CUSUM reference value k, in robust z units: growth below it is ignored."""
    threshold: float = 30.0
    """CUSUM decision level h (robust z units accumulated)."""
    clip: float = 4.0
    """Each step contributes at most this many z: one outlier is not a drift."""
    severity: str = "warn"

    def __post_init__(self) -> None:
        if self.window < 8 or not 1 <= self.warmup <= self.window:
            raise ConfigError(f"need window >= 8 and 1 <= warmup <= window, got {self.window}, {self.warmup}")
        if self.threshold <= 0 or self.slack < 0 or self.clip <= self.slack:
            raise ConfigError("need threshold > 0, slack >= 0 and clip > slack")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity must be one of {SEVERITIES}")


class DriftDetector(Detector):
    """S = max(0, S + min(z, clip) - slack) per metric; alarm and reset when S > threshold."""

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
                med, scale = base.center_scale()
                z = min((x - med) / scale, cfg.clip)
                s = max(0.0, self.cusum[m] + z - cfg.slack)
                if s > 0 and self.cusum[m] == 0:
                    self.since[m] = step
                self.cusum[m] = s
                if s > cfg.threshold:
                    alarms.append(Alarm(
                        self.kind, m, step, cfg.severity,
                        f"{m} has been drifting up since step {self.since[m]} (now {x:.4g}, reference {med:.4g})",
                        {"value": x, "reference": med, "cusum": s, "since_step": self.since[m]},
                    ))
                    self.cusum[m] = 0.0
            base.push(x)
        return alarms

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
