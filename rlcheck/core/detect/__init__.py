"""Detectors: pure functions of the per-step metric stream (plus their own bounded history)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcheck.core.detect.base import KINDS, SEVERITIES, Alarm, Detector, severity_rank
from rlcheck.core.detect.periodic import PeriodicConfig, PeriodicDetector
from rlcheck.core.detect.robust import (
    CONTROL_DRIFT,
    CONTROL_TREND,
    RESIDUAL_TREND,
    DriftConfig,
    DriftDetector,
    RobustZConfig,
    RobustZDetector,
)
from rlcheck.core.detect.signature import SignatureConfig, SignatureDetector
from rlcheck.core.detect.threshold import DEFAULT_RULES, ThresholdConfig, ThresholdDetector, ThresholdRule
from rlcheck.core.detect.turns import TURN_Z
from rlcheck.core.model_types import dense_state_model, routes_no_experts


@dataclass(frozen=True)
class DetectorsConfig:
    """One config per detector; set one to None to switch that detector off."""

    threshold: ThresholdConfig | None = field(default_factory=ThresholdConfig)
    robust_z: RobustZConfig | None = field(default_factory=RobustZConfig)
    drift: DriftConfig | None = field(default_factory=DriftConfig)
    control_drift: DriftConfig | None = field(default_factory=lambda: CONTROL_DRIFT)
    """Fast drift of the sync check's probe batch (`Monitor.observe(..., probe=)`): the engine's own
    growth, free of what the policy samples; silent on a run that passes no probe."""
    control_trend: DriftConfig | None = field(default_factory=lambda: CONTROL_TREND)
    """Slow drift of the same probe batch (a longer reference)."""
    residual_trend: DriftConfig | None = field(default_factory=lambda: RESIDUAL_TREND)
    """Drift of the step's residual level (the token mix out): the engine's growth without a probe."""
    periodic: PeriodicConfig | None = field(default_factory=PeriodicConfig)
    signature: SignatureConfig | None = field(default_factory=SignatureConfig)
    turns: RobustZConfig | None = field(default_factory=lambda: TURN_Z)
    """Multi-turn batches: spikes of the later turns and the turns' heads against the rest of the step
    (`rlcheck.core.detect.turns`); silent on a run without turns."""


def build_detectors(cfg: DetectorsConfig, context: Mapping[str, Any] | None = None) -> dict[str, Detector]:
    """The enabled detectors, keyed by their field of `DetectorsConfig` (the kind, but for
    control_drift, control_trend and residual_trend: drift detectors; turns: a robust z). `context`: the
    Monitor's; its `model_type` and `experts` tell the signature detector whether the model has recurrent
    state and no experts (`rlcheck.core.model_types.dense_state_model`), and the threshold detector whether
    it routes none (`routes_no_experts`)."""
    makers = {
        "threshold": (cfg.threshold, ThresholdDetector),
        "robust_z": (cfg.robust_z, RobustZDetector),
        "drift": (cfg.drift, DriftDetector),
        "control_drift": (cfg.control_drift, DriftDetector),
        "control_trend": (cfg.control_trend, DriftDetector),
        "residual_trend": (cfg.residual_trend, DriftDetector),
        "periodic": (cfg.periodic, PeriodicDetector),
        "signature": (cfg.signature, SignatureDetector),
        "turns": (cfg.turns, RobustZDetector),
    }
    detectors = {name: cls(c) for name, (c, cls) in makers.items() if c is not None}
    if "signature" in detectors:  # a group off together is a stale state's shape on a dense model with state
        detectors["signature"].state_model = dense_state_model(context or {})
    if "threshold" in detectors:  # the trainer's measure bounds a dense model's noise, not a router's
        detectors["threshold"].dense = routes_no_experts(context or {})
    return detectors


__all__ = [
    "KINDS", "SEVERITIES", "Alarm", "Detector", "severity_rank", "DetectorsConfig", "build_detectors",
    "ThresholdConfig", "ThresholdRule", "ThresholdDetector", "DEFAULT_RULES",
    "RobustZConfig", "RobustZDetector", "DriftConfig", "DriftDetector", "CONTROL_DRIFT", "CONTROL_TREND", "RESIDUAL_TREND",
    "PeriodicConfig", "PeriodicDetector", "SignatureConfig", "SignatureDetector",
]
