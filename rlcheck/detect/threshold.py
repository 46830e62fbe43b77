"""Threshold detector: a metric above an absolute limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck import metrics as K
from rlcheck.detect.base import SEVERITIES, Alarm, Detector
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class ThresholdRule:
    """Raise an alarm of `severity` when `metric` > `limit`."""

    metric: str
    limit: float
    severity: str = "warn"
    note: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


# Gates that other RL stacks publish as their healthy range (README, metrics glossary).
DEFAULT_RULES = (
    ThresholdRule(K.MULT_PROB_ERROR, 1.05, "warn", "NeMo-RL's healthy gate mean(exp|d|) <= 1.05"),
    ThresholdRule(K.PROB_ABS_DIFF_MEAN, 0.01, "warn", "verl's probs_diff_mean alarm level"),
    ThresholdRule(K.ABS_DIFF_MEAN, 0.05, "warn", "mean |d| far above bf16 noise"),
)


@dataclass(frozen=True)
class ThresholdConfig:
    rules: tuple[ThresholdRule, ...] = DEFAULT_RULES
    """Every rule is checked every step; a metric absent from the step is skipped."""


class ThresholdDetector(Detector):
    kind = "threshold"

    def __init__(self, cfg: ThresholdConfig | None = None):
        self.cfg = cfg or ThresholdConfig()

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        alarms = []
        for rule in self.cfg.rules:
            value = metrics.get(rule.metric)
            if value is not None and value > rule.limit:
                why = f" ({rule.note})" if rule.note else ""
                alarms.append(Alarm(
                    self.kind, rule.metric, step, rule.severity,
                    f"{rule.metric} = {value:.4g} > {rule.limit:g}{why}",
                    {"value": value, "limit": rule.limit},
                ))
        return alarms

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
