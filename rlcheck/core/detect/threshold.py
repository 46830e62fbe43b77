"""Threshold detector: a metric above an absolute limit.

A level is news when it is first crossed, not on every step the run sits above it: after an alarm a
rule is quiet until its metric has been at or below the limit for `rearm` consecutive observations
(a healthy tiny Llama with a bf16 engine sits around verl's 0.01 probs_diff gate and would warn on
half of its steps; BENCHMARKS.md, "Field fidelity"). Hard limits (`HaltConfig.hard_limits`) are
checked by the Monitor every step, unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.detect.base import SEVERITIES, Alarm, Detector
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class ThresholdRule:
    """Raise an alarm of `severity` when `metric` > `limit`."""

    metric: str
    limit: float
    severity: str = "warn"
    note: str = ""
    scaled: bool = False
    """`limit` is set at the bf16 floor and scales with the run's (`Detector.scale`): 1e-3 x on fp32/fp32."""
    dense_only: bool = False
    """Checked only where the Monitor's context names a model that routes no experts (`ThresholdDetector.dense`)."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


# Absolute levels of a mismatch worth a look, on metrics one tail token cannot move far (docs/detectors.md;
# BENCHMARKS.md, "Field fidelity"). NeMo-RL's gate mean(exp|d|) <= 1.05 is not among
# them: one bf16 tail token at |d| = 8 in 20,000 tokens adds 0.15 to it, and it fired on about half of
# the steps of a healthy long-response stream.
DEFAULT_RULES = (
    ThresholdRule(K.PROB_ABS_DIFF_MEAN, 0.01, "warn", "verl's probs_diff_mean alarm level", scaled=True),
    ThresholdRule(K.ABS_DIFF_CLIPPED_MEAN, 0.05, "warn", "mean |d| (clipped) far above the precision's noise", scaled=True),
    # multi-turn steps only (`rlcheck.core.detect.turns`): turns >= 1 diluted by turn 0 in the step's own mean
    ThresholdRule(K.turn_metric("later", "abs_diff_clipped_mean"), 0.05, "warn", "turns >= 1 far above bf16 noise"),
    ThresholdRule(K.TURN_LATER_RATIO, 4.0, "warn", "turns >= 1 far off where turn 0 is not"),
    ThresholdRule(K.TURN_HEAD_BODY_RATIO, 8.0, "warn", "the turns' first tokens far off where the rest is not"),
    ThresholdRule(K.FLOOR_EXCESS, 2.0, "warn", "mean |d| (clipped) 2x the trainer's measure of the model's own "
                  "noise at the engine's precision", dense_only=True),
)
"""The first two set at the bf16 floor and scaled: on a fp32/fp32 run (floor scale 1e-3) they stand at 1e-5 and
5e-5. The multi-turn rules are not scaled (two ratios, and a level set at bf16 by their own calibration). The
last reads a step the trainer measured (`rlcheck.core.floors`: `floor/excess`, the clipped mean over the larger
of the measure and the precision's level) on a dense model: healthy bf16 runs stood at most 1.24x (the tiny
Llamas, hybrids and Mamba2, 44 runs of BENCHMARKS.md's rounds 6-7), a stale prefix cache on the random Llama
climbed past 2x within 1-7 steps under the clipped-mean gate's 5x; an MoE's healthy router noise sat 1.5-6x over
an autocast measure, so not there."""


@dataclass(frozen=True)
class ThresholdConfig:
    rules: tuple[ThresholdRule, ...] = DEFAULT_RULES
    """Every rule is checked every step; a metric absent from the step is skipped."""
    rearm: int | None = 32
    """Observations at or below the limit before a rule that fired may fire again; None: every step
    above the limit alarms."""

    def __post_init__(self) -> None:
        if self.rearm is not None and self.rearm < 1:
            raise ConfigError(f"rearm must be None or >= 1, got {self.rearm}")


class ThresholdDetector(Detector):
    kind = "threshold"

    def __init__(self, cfg: ThresholdConfig | None = None):
        self.cfg = cfg or ThresholdConfig()
        self.dense: bool | None = None
        """The model routes no experts (`rlcheck.core.model_types.routes_no_experts` of the Monitor's context;
        None: unknown), set by `build_detectors`: the `dense_only` rules are checked only when True."""
        self.quiet = [0] * len(self.cfg.rules)
        """Per rule: observations below the limit still owed before it re-arms (0: armed)."""

    def update(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        alarms = []
        for i, rule in enumerate(self.cfg.rules):
            value = metrics.get(rule.metric)
            if value is None or (rule.dense_only and self.dense is not True):
                continue
            limit = rule.limit * (self.scale if rule.scaled else 1.0)
            if value <= limit:
                self.quiet[i] = max(self.quiet[i] - 1, 0)
                continue
            if self.quiet[i] and self.cfg.rearm is not None:
                self.quiet[i] = self.cfg.rearm  # still above: the quiet time starts over
                continue
            self.quiet[i] = self.cfg.rearm or 0
            floor = f"{rule.limit:g} x {self.scale:g} at this run's precision floor" if rule.scaled and self.scale != 1.0 else ""
            why = f" ({'; '.join(x for x in (rule.note, floor) if x)})" if rule.note or floor else ""
            later = f"; quiet until {self.cfg.rearm} steps back at or below it" if self.cfg.rearm else ""
            alarms.append(Alarm(
                self.kind, rule.metric, step, rule.severity,
                f"{rule.metric} = {value:.4g} > {limit:g}{why}{later}",
                {"value": value, "limit": limit},
            ))
        return alarms

    def state_dict(self) -> dict[str, Any]:
        return {"quiet": list(self.quiet)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        quiet = list(state.get("quiet", ()))
        if len(quiet) == len(self.quiet):
            self.quiet = [int(q) for q in quiet]
