"""A stream model of what healthy looks like in a real bf16 run, and the faults laid on it.

One `FieldStream` is a run: observation i (`0..num_steps-1`) is step `i * step_stride` (TRL generates
once per `num_iterations` optimizer steps, so the Monitor sees 0, 2, 4, ...), made of one `StepBatch`
per rank. Per token, with s = -logp_rollout the token's surprise,

    d = floor(i) * level(i) * (1 - p)^surprise_power * e / E[...],   p = exp(-s)

where |e| is log-normal (`noise_sigma`), its sign negative with probability `negative_frac` and e
exactly 0 for a fraction `zero_frac` of the tokens (bf16 rounds both sides alike), the denominator
makes mean |d| = floor(i) * level(i) in expectation (d log p / d logit = 1 - p: a near-certain token
barely moves), `floor(i)` grows geometrically by `growth` over `growth_steps` steps, and the step
level is an AR(1) process in log space (`level_ar`, stationary std `level_sigma`, Student-t 5
innovations): the autocorrelated, heavy-tailed step-to-step wobble of batch composition. On top,
a fraction `tail_rate` of the uncertain tokens are tail tokens with |d| log-uniform in
[tail_min, tail_max] nats, mostly negative (`tail_negative`): a bf16 engine sampling a token it
over-rates. Response lengths are log-normal (median `median_length`, `length_sigma`), capped at
`max_length`; a fraction `confident_frac` of the tokens are near-certain (s ~ Exp(confident_scale)),
the rest s ~ Exp(open_scale), as in a trained LM.

The defaults are the fit of `benchmarks/field_fit.py` to the real loops of this repository (bf16
vLLM against an fp32 trainer, BENCHMARKS.md "Field fidelity"), with the published floor (~1e-3
early, ~1e-2 late) for level and growth. `FieldFault` lays a fault on the stream (the fault zoo's
shapes, at field scale). Everything is deterministic in (seed, observation).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.errors import ConfigError
from rlcheck.synthetic.basic import read_shifted


@dataclass(frozen=True)
class FieldConfig:
    num_sequences: int = 24
    """Sequences per rank per step."""
    num_ranks: int = 1
    median_length: int = 900
    length_sigma: float = 0.9
    max_length: int = 32768
    confident_frac: float = 0.7
    confident_scale: float = 0.02
    open_scale: float = 1.6
    floor: float = 1e-3
    """Mean |d| at step 0."""
    growth: float = 10.0
    """The floor multiplies by this over `growth_steps` steps."""
    growth_steps: int = 2000
    surprise_power: float = 0.9
    """Measured: 0.91 (trained Llama), 0.97 (trained hybrid), bf16 vLLM against an fp32 trainer."""
    noise_sigma: float = 1.45
    """Std of log|e|. Measured: 1.45 (Llama), 1.17 (hybrid)."""
    zero_frac: float = 0.1
    """Measured: 10-22% of the tokens have d exactly 0."""
    negative_frac: float = 0.54
    """Measured: mean d / mean |d| = -0.04 to -0.19 (the trainer a little less sure)."""
    level_ar: float = 0.7
    """AR(1) coefficient of the step level. Measured here 0.12 (lag 1, detrended, 200 steps of the
    trained Llama); the field's runs are autocorrelated (curricula, batch composition), so the
    scenarios take 0.7 unless they say otherwise: the harder case for every rolling detector."""
    level_sigma: float = 0.15
    rank_spread: float = 0.05
    """Std of a fixed per-rank log level offset (ranks on different devices differ slightly)."""
    tail_rate: float = 3e-4
    """Fraction of the uncertain tokens that are tail tokens."""
    tail_min: float = 0.5
    tail_max: float = 8.0
    tail_negative: float = 0.8
    step_stride: int = 1
    length_growth: float = 1.0
    """The median response length multiplies by this over `growth_steps` steps (then stays)."""
    confident_frac_end: float | None = None
    """`confident_frac` at `growth_steps` (linear in the step, then stays); None: constant. Fewer
    near-certain tokens raise mean |d| through the token mix alone (the per-token law, and so the
    probe batch, unchanged): a policy whose responses get less peaked."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sequences", "num_ranks", "median_length", "max_length", "step_stride", "growth_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.confident_frac < 1 or not 0 <= self.tail_rate < 1 or not 0 <= self.level_ar < 1:
            raise ConfigError("confident_frac, tail_rate and level_ar must be in [0, 1)")
        if not (self.floor > 0 and self.growth > 0 and self.noise_sigma > 0 and self.tail_max > self.tail_min > 0):
            raise ConfigError("need floor > 0, growth > 0, noise_sigma > 0 and tail_max > tail_min > 0")
        if self.length_growth <= 0 or not 0 <= (self.confident_frac_end or 0.0) < 1:
            raise ConfigError("need length_growth > 0 and confident_frac_end in [0, 1)")


@dataclass(frozen=True)
class FieldFault:
    """A fault laid on a `FieldStream` from observation `onset` on.

    kinds: "skip-sync" (every `every`-th observation the rollouts come from weights one update old:
    an extra policy difference of `policy_step` mean |d|), "stale-weights" (no sync from onset: the
    difference grows as policy_step * lag^0.85, the growth the real loop's stale-weights drill
    showed), "off-by-one" (the trainer's logprobs and ids read one token late), "temperature"
    (`value` = trainer temperature / engine temperature: logp_train = logp_rollout / value),
    "corrupt-seqs" (each sequence with probability `value` is confident gibberish from one of its
    first three tokens: the trainer finds its tokens 2-4 nats less likely), "spikes" (every
    `every`-th observation the noise is `value` x the floor: the shape of a periodic fault too small
    for any threshold), "partial-spikes" (the same on a fraction `frac` of the observation's
    sequences only: a fault of one engine replica or one cache region), "drift" (the engine's own
    per-token mismatch multiplies geometrically by `value` over `ramp` observations from onset and
    stays there: the policy's samples are unchanged, the probe batch sees it too).
    """

    kind: str
    onset: int = 0
    every: int = 12
    value: float = 2.0
    policy_step: float = 2e-3
    frac: float = 1.0
    """partial-spikes: the fraction of each spiked observation's sequences that spike."""
    ramp: int = 30
    """drift: observations over which the engine's mismatch grows by `value`."""

    KINDS = ("skip-sync", "stale-weights", "off-by-one", "temperature", "corrupt-seqs", "spikes",
             "partial-spikes", "drift")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ConfigError(f"unknown field fault {self.kind!r}; known: {self.KINDS}")
        if self.onset < 0 or self.every < 2 or self.ramp < 1 or not 0 < self.frac <= 1:
            raise ConfigError("need onset >= 0, every >= 2, ramp >= 1 and 0 < frac <= 1")

    def hits(self, i: int) -> bool:
        """True when observation i is touched by the fault."""
        if i < self.onset:
            return False
        if self.kind in ("skip-sync", "spikes", "partial-spikes"):
            return (i - self.onset) % self.every == 0
        return True

    def engine_factor(self, i: int) -> float:
        """The engine's mismatch at observation i over its healthy level (1 but for a drift)."""
        if self.kind != "drift" or i < self.onset:
            return 1.0
        return self.value ** (min(i - self.onset, self.ramp) / self.ramp)

    @property
    def name(self) -> str:
        v = {"temperature": f"={self.value:g}", "corrupt-seqs": f"={self.value:g}",
             "spikes": f"={self.value:g}x/{self.every}", "skip-sync": f"={self.every}",
             "partial-spikes": f"={self.value:g}x{self.frac:.2g}/{self.every}",
             "drift": f"={self.value:g}x/{self.ramp}"}.get(self.kind, "")
        return f"{self.kind}{v}@{self.onset}"


_T5_STD = math.sqrt(5.0 / 3.0)


class FieldStream:
    """Observation i of the run: `step(i)` its step number, `batches(i)` one StepBatch per rank."""

    def __init__(self, cfg: FieldConfig, fault: FieldFault | None = None, num_steps: int = 2000):
        self.cfg, self.fault = cfg, fault
        self.num_steps = num_steps
        rng = np.random.default_rng([cfg.seed, 0x1E7E1])
        innov = np.clip(rng.standard_t(5, num_steps), -8, 8) / _T5_STD * cfg.level_sigma * math.sqrt(1 - cfg.level_ar**2)
        x = np.zeros(num_steps)
        x[0] = innov[0] / math.sqrt(1 - cfg.level_ar**2)
        for i in range(1, num_steps):
            x[i] = cfg.level_ar * x[i - 1] + innov[i]
        self.log_level = x  # (num_steps,)
        self.rank_offset = rng.normal(0.0, cfg.rank_spread, cfg.num_ranks)  # (R,)
        self._norm = self._noise_norm()
        self.touched: set[int] = set()
        """Observations the fault changed (ground truth: corrupt-seqs touches a step only when one of
        its sequences drew the fault)."""

    def step(self, i: int) -> int:
        return i * self.cfg.step_stride

    def floor(self, i: int) -> float:
        """The healthy mean |d| level of observation i (before the step wobble)."""
        c = self.cfg
        return c.floor * c.growth ** (self.step(i) / c.growth_steps)

    def engine_level(self, i: int) -> float:
        """The engine's mean |d| level at observation i: the floor, times a drift fault's factor."""
        return self.floor(i) * (self.fault.engine_factor(i) if self.fault is not None else 1.0)

    def probe_batch(self, i: int, num_tokens: int = 4096, num_sequences: int = 16) -> StepBatch:
        """The sync check's fixed probe batch scored at observation i: the same teacher-forced tokens
        every time (drawn once from the seed), their mismatch the engine's level with fresh bf16
        noise, and no step wobble (what the policy samples does not enter it)."""
        c = self.cfg
        s = np.minimum(self._surprise(np.random.default_rng([c.seed, 0x9B0BE]), num_tokens), 30.0)  # (T,)
        rng = np.random.default_rng([c.seed, i, 0x9B0BE])
        d = self._noise(rng, num_tokens) * self.engine_level(i) * self._shape(s) / self._norm
        tail = (rng.random(num_tokens) < c.tail_rate) & (s > 0.5)
        d[tail] = -np.exp(rng.uniform(math.log(c.tail_min), math.log(c.tail_max), int(np.count_nonzero(tail))))
        cu = np.linspace(0, num_tokens, num_sequences + 1).astype(np.int64)
        ids = [f"probe-{k}" for k in range(num_sequences)]
        return StepBatch.from_packed((-s).astype(np.float32), np.minimum(d - s, 0.0).astype(np.float32), cu, ids)

    def _noise_norm(self) -> float:
        """E[(1 - p)^power * |e|] over the token mix, so that mean |d| = floor * level."""
        c = self.cfg
        rng = np.random.default_rng([c.seed, 0xA0A])
        s = self._surprise(rng, 200_000)
        return float(np.mean(self._shape(s) * np.abs(self._noise(rng, s.shape[0]))))

    def _shape(self, s: np.ndarray) -> np.ndarray:
        return (-np.expm1(-s)) ** self.cfg.surprise_power  # (1 - p)^power

    def _noise(self, rng: np.random.Generator, m: int) -> np.ndarray:
        """(M,) signed unit noise: log-normal magnitude (median 1), some exact zeros."""
        c = self.cfg
        mag = np.exp(c.noise_sigma * rng.standard_normal(m))
        sign = np.where(rng.random(m) < c.negative_frac, -1.0, 1.0)
        return np.where(rng.random(m) < c.zero_frac, 0.0, sign * mag)

    def _surprise(self, rng: np.random.Generator, m: int, confident_frac: float | None = None) -> np.ndarray:
        c = self.cfg
        confident = rng.random(m) < (c.confident_frac if confident_frac is None else confident_frac)
        return np.where(confident, rng.exponential(c.confident_scale, m), rng.exponential(c.open_scale, m))

    def batches(self, i: int) -> list[StepBatch]:
        return [self._batch(i, r) for r in range(self.cfg.num_ranks)]

    def _batch(self, i: int, rank: int) -> StepBatch:
        c, f = self.cfg, self.fault
        rng = np.random.default_rng([c.seed, i, rank])
        n = c.num_sequences
        t = min(self.step(i) / c.growth_steps, 1.0)
        median = c.median_length * c.length_growth**t
        lens = np.clip(rng.lognormal(math.log(median), c.length_sigma, n), 1, c.max_length).astype(np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # (N+1,)
        m = int(cu[-1])
        end = c.confident_frac if c.confident_frac_end is None else c.confident_frac_end
        s = np.minimum(self._surprise(rng, m, c.confident_frac + (end - c.confident_frac) * t), 30.0)  # (M,)
        lr = -s
        level = self.engine_level(i) * math.exp(self.log_level[i] + self.rank_offset[rank])
        hit = f is not None and f.hits(i)
        if hit and f.kind == "spikes":
            level *= f.value
        shape = self._shape(s) / self._norm  # (M,)
        d = self._noise(rng, m) * level * shape
        if hit and f.kind == "partial-spikes":
            picked = np.random.default_rng([c.seed, i, rank, 0x5B1]).permutation(n)[: max(1, round(f.frac * n))]
            d[np.isin(np.repeat(np.arange(n), lens), picked)] *= f.value
        if hit and f.kind in ("skip-sync", "stale-weights"):
            lag = 1 if f.kind == "skip-sync" else i - f.onset + 1
            d += self._noise(rng, m) * (f.policy_step * lag**0.85) * shape
        tail = (rng.random(m) < c.tail_rate) & (s > 0.5)
        num_tail = int(np.count_nonzero(tail))
        mag = np.exp(rng.uniform(math.log(c.tail_min), math.log(c.tail_max), num_tail))
        sign = np.where(rng.random(num_tail) < c.tail_negative, -1.0, 1.0)
        d[tail] = sign * mag
        lt = np.minimum(lr + d, 0.0)
        tokens = rng.integers(0, 32000, m)
        ids = [f"r{rank}-s{self.step(i)}-{k}" for k in range(n)]
        batch = StepBatch.from_packed(lr.astype(np.float32), lt.astype(np.float32), cu, ids, tokens=tokens)
        if not hit:
            return batch
        out = self._fault_data(batch, rng, i)
        if f.kind != "corrupt-seqs" or out is not batch:
            self.touched.add(i)
        return out

    def _fault_data(self, batch: StepBatch, rng: np.random.Generator, i: int) -> StepBatch:
        f, cu = self.fault, batch.cu_seqlens
        lr, lt = batch.logp_rollout, batch.logp_train
        if f.kind == "temperature":
            return dataclasses.replace(batch, logp_train=np.minimum(lr / f.value + (lt - lr), 0.0).astype(lt.dtype))
        if f.kind == "off-by-one":
            return read_shifted(batch)[0]
        if f.kind == "corrupt-seqs":
            picked = np.flatnonzero(rng.random(batch.num_sequences) < f.value)
            if picked.size == 0:
                return batch
            lt = lt.copy()
            for k in picked:
                a, b = int(cu[k]), int(cu[k + 1])
                p = a + int(rng.integers(0, min(3, b - a)))
                lt[p:b] = lr[p:b] - rng.uniform(2.0, 4.0, b - p)
            return dataclasses.replace(batch, logp_train=lt)
        return batch
