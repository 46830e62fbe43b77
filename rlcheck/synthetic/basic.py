"""A realistic synthetic step stream, for the demo and for tests of the monitor end to end.

Each step holds `num_sequences` responses of skewed (log-normal) lengths. Rollout logprobs mix
confident tokens and high-entropy ones; the trainer's differ by bf16-like numeric noise whose size
grows with the token's surprise (-logp), as real kernel noise does, and whose level varies from
step to step with heavy tails, as batch composition makes it. Faults are data-level:

- `spike_every=P` (with `spike_phase`): every P-th step the noise is scaled up by `spike_scale`,
  the shape a weight sync skipped every P steps or an index that wraps periodically leaves; at the
  default scale the spike moves mean |d| by a few MAD, far below any absolute threshold.
- `corrupt_every_step=n`: n sequences per step are rescored as if from a stale state (every token
  off by 2-4 nats from its first token on).

`read_shifted(batch)` is the shape of an off-by-one on any batch: the trainer's side read one token
late (or early), which the fault zoo's `off-by-one` and the field streams inject.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.errors import ConfigError


@dataclass(frozen=True)
class SyntheticConfig:
    num_sequences: int = 256
    mean_length: int = 160
    noise: float = 2e-3
    """Numeric noise scale: std of d for a token of logp = -1."""
    spike_every: int | None = None
    spike_phase: int = 0
    spike_start: int = 0
    """No spike before this step (the detectors first see a clean history)."""
    spike_scale: float = 1.4
    step_variation: float = 0.1
    """Step-to-step variation of the noise level (batch composition), heavy-tailed (Student-t 5)."""
    corrupt_every_step: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sequences < 1 or self.mean_length < 1:
            raise ConfigError("num_sequences and mean_length must be >= 1")
        if self.spike_every is not None and self.spike_every < 2:
            raise ConfigError(f"spike_every must be >= 2, got {self.spike_every}")


def is_spike(cfg: SyntheticConfig, step: int) -> bool:
    return (
        cfg.spike_every is not None
        and step >= cfg.spike_start
        and step % cfg.spike_every == cfg.spike_phase % cfg.spike_every
    )


def synthetic_batch(cfg: SyntheticConfig, step: int) -> StepBatch:
    """The batch of `step` (deterministic in cfg.seed and step)."""
    rng = np.random.default_rng([cfg.seed, step])
    n = cfg.num_sequences
    lens = np.maximum(1, rng.lognormal(np.log(cfg.mean_length) - 0.5, 1.0, n)).astype(np.int64)  # (N,)
    m = int(lens.sum())
    confident = rng.random(m) < 0.7
    logp_rollout = np.where(confident, -rng.exponential(0.05, m), -rng.exponential(2.5, m))  # (M,)
    logp_rollout = np.maximum(logp_rollout, -30.0).astype(np.float32)
    level = np.exp(cfg.step_variation * np.clip(rng.standard_t(5), -5.0, 5.0))  # this step's noise level
    scale = cfg.noise * level * (1.0 + np.abs(logp_rollout))
    if is_spike(cfg, step):
        scale = scale * cfg.spike_scale
    logp_train = (logp_rollout + rng.normal(0.0, 1.0, m) * scale).astype(np.float32)
    logp_train = np.minimum(logp_train, 0.0)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    for i in rng.choice(n, size=min(cfg.corrupt_every_step, n), replace=False):
        s, e = cu[i], cu[i + 1]
        logp_train[s:e] = logp_rollout[s:e] - rng.uniform(2.0, 4.0, e - s).astype(np.float32)
    ids = [f"step{step}-req{i}" for i in range(n)]
    tokens = rng.integers(0, 32000, m)
    return StepBatch.from_packed(logp_rollout, logp_train, cu, ids, tokens=tokens)


def read_shifted(batch: StepBatch, late: bool = True) -> tuple[StepBatch, list[str]]:
    """(`batch` with the trainer's logprobs, and the ids it scored, read one token late: position t holds
    t + 1's, the last token its own; `late` False: one early, t holds t - 1's, the first its own), the
    request ids of the sequences it shifted (two tokens or more)."""
    lt = batch.logp_train.copy()
    tokens = batch.tokens_train if batch.tokens_train is not None else batch.tokens
    tt = None if tokens is None else tokens.copy()
    hit = []
    cu = batch.cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if b - a >= 2:
            to, src = (slice(a, b - 1), slice(a + 1, b)) if late else (slice(a + 1, b), slice(a, b - 1))
            lt[to] = batch.logp_train[src]
            if tt is not None:
                tt[to] = tokens[src]
            hit.append(batch.request_ids[i])
    return dataclasses.replace(batch, logp_train=lt, tokens_train=tt), hit
