"""`PreflightConfig`: what the two sides of a run will do, as far as a preflight needs to know, and the
names it accepts for vLLM's logprobs modes and for dtypes.

    cfg = PreflightConfig(model="models/a", engine_model="models/b", temperature=0.7, logprobs_mode="raw")
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from rlcheck.errors import ConfigError

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
"""vLLM 0.32's `logprobs_mode` values (vllm.config.model.LogprobsMode)."""
SHORT_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
"""Spellings of a dtype (vLLM's, torch's, verl's) -> the torch name."""
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def canonical_dtype(name: str | None, what: str = "dtype") -> str | None:
    """"bf16", "torch.bfloat16", "bfloat16" -> "bfloat16"; None stays None; "auto" stays "auto"."""
    if name is None:
        return None
    key = str(name).removeprefix("torch.").lower()
    if key == "auto":
        return "auto"
    if key not in DTYPE_NAMES:
        raise ConfigError(f"{what} {name!r} is not a dtype rlcheck knows; use one of float32, bfloat16, float16 or auto")
    return DTYPE_NAMES[key]


def canonical_mode(mode: str) -> str:
    """"raw" / "processed" (or vLLM's own names) -> vLLM's `logprobs_mode` name."""
    mode = SHORT_MODES.get(mode, mode)
    if mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be raw, processed or one of {LOGPROBS_MODES}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class PreflightConfig:
    """The two sides' settings a preflight compares; validated (and spellings normalised) on creation."""

    model: str
    """The trainer's model folder (HF layout): the config, tokenizer and weights it scores with."""
    engine_model: str | None = None
    """The engine's model folder; None: the same as `model`."""
    engine_overrides: dict[str, Any] | None = None
    """vLLM's `hf_overrides` of the engine: config fields set over the engine model's config.json, as vLLM
    sets them (`rlcheck.preflight.sides.with_overrides`); None: none."""
    temperature: float = 1.0
    """The engine's sampling temperature."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: off (vLLM's -1, TRL's 0)."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs_mode: str = "processed_logprobs"
    """vLLM's `logprobs_mode` ("raw" and "processed" are accepted for raw_logprobs and processed_logprobs)."""
    dtype: str | None = None
    """The engine's dtype; None: the engine model's config dtype; "auto": vLLM's rule (a float32
    checkpoint runs in bfloat16)."""
    trainer_dtype: str | None = None
    """The dtype the trainer computes its logprobs in; None: the trainer model's config dtype."""
    trainer_temperature: float | None = None
    """The temperature the trainer scores at, log_softmax(logits / T); None: `temperature` (what
    rlcheck's trainers, TRL and verl do). The trainer never applies top-p, top-k, min-p or penalties."""
    prefix_caching: bool = True
    """The engine caches prompt prefixes (vLLM's default)."""
    resets_prefix_cache: bool | None = None
    """Whatever syncs the weights calls `reset_prefix_cache()` after each sync; None: not known."""
    enforce_eager: bool | None = None
    """The engine runs eager on a GPU (no CUDA graphs); None: not known, or no GPU (nothing to say)."""
    probe_tokens: int = 16
    """The dynamic probe: greedy tokens appended to each probe prompt, then scored by both sides."""
    kv_cache_bytes: int | None = None
    """The probe engine's KV cache; None: 256 MiB on CPU, vLLM's default on a GPU."""
    trainer_device: str | None = None
    """Where the probe's trainer side scores: the trainer's device ("cuda", "cuda:1", "cpu"); None: where
    a trainer runs, the GPU when there is one, else the CPU (`rlcheck.preflight.dynamic.probe_device`)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must name the trainer's model folder")
        if self.engine_overrides is not None and not isinstance(self.engine_overrides, dict):
            raise ConfigError(f"engine_overrides must be a dict of config fields (vLLM's hf_overrides), "
                              f"got {type(self.engine_overrides).__name__}")
        object.__setattr__(self, "logprobs_mode", canonical_mode(self.logprobs_mode))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "dtype"))
        trainer_dtype = canonical_dtype(self.trainer_dtype, "trainer_dtype")
        if trainer_dtype == "auto":
            raise ConfigError("trainer_dtype must be a dtype (float32, bfloat16, float16), not auto")
        object.__setattr__(self, "trainer_dtype", trainer_dtype)
        for name in ("temperature", "trainer_temperature", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1:
            raise ConfigError(f"top_p must be in (0, 1] and min_p in [0, 1), got top_p={self.top_p}, min_p={self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k must be an integer >= -1 (0 and -1: off), got {self.top_k!r}")
        if self.probe_tokens < 1:
            raise ConfigError(f"probe_tokens must be >= 1, got {self.probe_tokens}")
        if self.trainer_device is not None and not DEVICE.fullmatch(str(self.trainer_device)):
            raise ConfigError(f"trainer_device must be cpu, cuda or cuda:N, got {self.trainer_device!r}")

    @property
    def engine_path(self) -> str:
        return self.engine_model or self.model

    @property
    def scored_temperature(self) -> float:
        """The temperature the trainer scores at."""
        return self.temperature if self.trainer_temperature is None else self.trainer_temperature
