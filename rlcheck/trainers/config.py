"""The trainer's one config dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from rlcheck.errors import ConfigError

BACKENDS = ("hf", "fsdp2", "deepspeed")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TrainerConfig:
    model: str
    """Local model directory (HF layout); every rank loads it."""
    backend: str = "fsdp2"
    """hf (one process, no sharding), fsdp2 (`fully_shard` per decoder layer and the root) or deepspeed."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage (1, 2 or 3); ignored by the other backends."""
    dtype: str = "float32"
    """Parameter dtype (bfloat16 on GPUs is usual; the rollout engine should use the same)."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """PPO clip range for the ratio: [1 - clip_low, 1 + clip_high] (DAPO raises clip_high)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts: logprobs are log_softmax(logits / temperature)."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward (prompt + response tokens) per rank."""
    seed: int = 0
    device: str = "cpu"
    """cpu, or cuda (the rank's local device)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"zero_stage must be 1, 2 or 3, got {self.zero_stage}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.lr > 0 or self.max_grad_norm < 0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, max_grad_norm >= 0 and weight_decay >= 0")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.micro_batch_tokens < 2:
            raise ConfigError(f"micro_batch_tokens must be >= 2, got {self.micro_batch_tokens}")
