"""Synthetic multi-turn streams: agent trajectories (model turns with tool replies between them) whose
per-token mismatch follows the field model of a healthy bf16 run (`rlcheck.synthetic.field`), built
the way an agent loop's adapter builds them (`StepBatch.from_turns`, token in / token out: call k+1's
prompt is call k's prompt, its output and the reply), with a multi-turn fault laid on top
(`rlcheck.faults.turns`).

    stream = MultiTurnStream(MultiTurnConfig(seed=3), fault=StaleTurn(start=500), num_steps=10_000)
    for i in range(stream.num_steps):
        batch = stream.batch(i)          # trainer_version for Monitor.observe: stream.trainer_version(i)

Turn 0 is long (the first answer, a plan), later turns short (a tool call, the final answer): turn 0
holds most of the tokens, so a fault confined to later turns barely moves the step's overall statistics.
Each observation ends with the `header` ids (the generation prompt the template puts before the next
turn). Every call is served by the trainer's weights version (`trainer_version`), on-policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.turns_build import Trajectory, Turn
from rlcheck.errors import ConfigError
from rlcheck.synthetic.field import FieldConfig, FieldStream


@dataclass(frozen=True)
class MultiTurnConfig:
    field: FieldConfig = field(default_factory=lambda: FieldConfig(num_sequences=16, growth_steps=10_000))
    """The per-token law, the step wobble and the floor (its lengths are not used); the floor grows 10x over
    10,000 steps (1e-3 to 1e-2, the published range), so a 10,000-step stream stays a healthy one."""
    min_turns: int = 2
    max_turns: int = 5
    first_length: int = 300
    """Median length of turn 0's output."""
    turn_length: int = 40
    """Median length of every later turn's output."""
    length_sigma: float = 0.5
    observation_length: int = 24
    """Median length of a tool reply (with the template's tokens and the `header`)."""
    header: tuple[int, ...] = (32001, 32002)
    prompt_length: int = 48
    vocab: int = 32000
    tool_logprob: float = 4.0
    """The trainer's mean -logprob of a tool reply's tokens (text the model did not write)."""
    mask_runs: bool = False
    """Keep no turn boundaries (as verl and TRL): turns from the mask's runs, records without prompts."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_turns <= self.max_turns:
            raise ConfigError(f"need 1 <= min_turns <= max_turns, got {self.min_turns}, {self.max_turns}")
        if min(self.first_length, self.turn_length, self.prompt_length) < 1 or self.observation_length <= len(self.header):
            raise ConfigError("lengths must be >= 1 and observation_length longer than the header")


class MultiTurnStream(FieldStream):
    """Observation i: `batch(i)` (one rank), `trainer_version(i)`; `fault` any `rlcheck.faults.turns` fault."""

    def __init__(self, cfg: MultiTurnConfig | None = None, fault=None, num_steps: int = 2000):
        self.turn_cfg = cfg or MultiTurnConfig()
        super().__init__(self.turn_cfg.field, None, num_steps)
        self.turn_fault = fault

    def trainer_version(self, i: int) -> int:
        return self.step(i)

    def batches(self, i: int) -> list[StepBatch]:
        return [self.batch(i)]

    def batch(self, i: int) -> StepBatch:
        c = self.turn_cfg
        rng = np.random.default_rng([c.field.seed, i, 0x7E2])
        level = self.engine_level(i) * math.exp(self.log_level[i] + self.rank_offset[0])
        trajectories = [self._trajectory(rng, level, i) for _ in range(c.field.num_sequences)]
        ids = [f"s{self.step(i)}-{k}" for k in range(len(trajectories))]
        batch = StepBatch.from_turns(trajectories, ids)
        if c.mask_runs:
            records = [type(r)(num_turns=r.num_turns, versions=r.versions) for r in batch.turns.records]
            batch = batch.with_turns("mask_runs", records=records)
        if self.turn_fault is not None:
            batch, touched = self.turn_fault.apply(self.step(i), batch)
            if touched:
                self.touched.add(i)
        return batch

    def _lengths(self, rng: np.random.Generator, median: int, size: int) -> np.ndarray:
        return np.clip(rng.lognormal(math.log(median), self.turn_cfg.length_sigma, size), 1, 8 * median).astype(np.int64)

    def _trajectory(self, rng: np.random.Generator, level: float, i: int) -> Trajectory:
        c, f = self.turn_cfg, self.turn_cfg.field
        k = int(rng.integers(c.min_turns, c.max_turns + 1))
        lens = np.concatenate([self._lengths(rng, c.first_length, 1), self._lengths(rng, c.turn_length, k - 1)])
        obs_lens = np.maximum(self._lengths(rng, c.observation_length, k - 1), len(c.header) + 1)
        m = int(lens.sum())
        s = np.minimum(self._surprise(rng, m), 30.0)  # (m,) the model tokens' surprise
        d = self._noise(rng, m) * level * self._shape(s) / self._norm
        tail = (rng.random(m) < f.tail_rate) & (s > 0.5)
        d[tail] = np.where(rng.random(int(tail.sum())) < f.tail_negative, -1.0, 1.0) * np.exp(
            rng.uniform(math.log(f.tail_min), math.log(f.tail_max), int(tail.sum())))
        lr, lt = -s, np.minimum(-s + d, 0.0)
        context = rng.integers(0, c.vocab, c.prompt_length)
        turns, train, cut = [], [], np.concatenate([[0], np.cumsum(lens)])
        for t in range(k):
            out = rng.integers(0, c.vocab, int(lens[t]))
            obs = () if t == k - 1 else np.concatenate([rng.integers(0, c.vocab, int(obs_lens[t]) - len(c.header)),
                                                        c.header])
            a, b = int(cut[t]), int(cut[t + 1])
            turns.append(Turn(out, lr[a:b], prompt_ids=context, observation_ids=obs, version=self.trainer_version(i)))
            train += [lt[a:b], -(rng.exponential(c.tool_logprob, len(obs)))]
            context = np.concatenate([context, out, obs])
        return Trajectory(turns, np.concatenate(train), num_turns=k)
