"""What a step's sequences are, and which rank scores which of them in which micro-batch.

FSDP2 and ZeRO-3 gather weights collectively in every forward, so all ranks must run the same number
of forwards. `plan_micro_batches` balances the sequences over the ranks by token count, cuts each
rank's share into micro-batches under a token budget, and gives every rank as many micro-batches as
the busiest one (a rank with nothing left runs an empty one: a 2-token dummy forward, loss x 0).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlcheck.errors import InputError


@dataclass(frozen=True)
class Sequences:
    """One step's sequences: prompt and response token ids, and per sequence what the update needs."""

    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]
    advantages: np.ndarray | None = None
    """(N,) float32, one per sequence (GRPO: group-normalised reward); needed by `train_step`."""
    old_logp: tuple[np.ndarray, ...] | None = None
    """Per sequence, the response tokens' logprobs the ratio is taken against (the policy that
    sampled them, recomputed under the training weights: on-policy, ratio 1 at the first update)."""
    weights: tuple[np.ndarray, ...] | None = None
    """Per sequence, each response token's weight in the loss (float32; 0 drops the token): the
    monitor's keep mask and importance-sampling correction (`StepReport.correction`). None: all 1."""
    loss_tokens: int | None = None
    """The tokens the loss averages over (those a correction's mask keeps); None: every response token."""
    topk_ids: tuple[np.ndarray, ...] | None = None
    """Per sequence, (L_i, K) int64 ids (the engine's top-K of each response token, -1 = padding) the
    trainer's logprobs are also asked at (`PolicyTrainer.topk_logprobs`); None: not asked."""

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.responses) or not self.prompts:
            raise InputError(f"need as many prompts as responses (> 0), got {len(self.prompts)} and {len(self.responses)}")
        for i, (p, r) in enumerate(zip(self.prompts, self.responses, strict=True)):
            if not p or not r:
                raise InputError(f"sequence {i}: prompt and response must both be non-empty")
        if self.advantages is not None and len(self.advantages) != len(self.prompts):
            raise InputError(f"{len(self.advantages)} advantages for {len(self.prompts)} sequences")
        if self.old_logp is not None:
            bad = [i for i, (lp, r) in enumerate(zip(self.old_logp, self.responses, strict=True)) if len(lp) != len(r)]
            if bad:
                raise InputError(f"old_logp length differs from the response length for sequences {bad[:5]}")
        if self.weights is not None:
            bad = [i for i, (w, r) in enumerate(zip(self.weights, self.responses, strict=True)) if len(w) != len(r)]
            if len(self.weights) != len(self.prompts) or bad:
                raise InputError(f"loss weights must match the response lengths (sequences {bad[:5]})")
        if self.topk_ids is not None:
            bad = [i for i, (x, r) in enumerate(zip(self.topk_ids, self.responses, strict=False))
                   if x.ndim != 2 or x.shape[0] != len(r)]
            if len(self.topk_ids) != len(self.prompts) or bad or len({x.shape[-1] for x in self.topk_ids}) > 1:
                raise InputError(f"topk_ids must be one (L_i, K) array per sequence, the same K for all "
                                 f"(sequences {bad[:5]} differ from their response length)")

    @classmethod
    def build(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              advantages: Sequence[float] | None = None, old_logp: Sequence[np.ndarray] | None = None) -> Sequences:
        return cls(
            prompts=tuple(tuple(int(t) for t in p) for p in prompts),
            responses=tuple(tuple(int(t) for t in r) for r in responses),
            advantages=None if advantages is None else np.asarray(advantages, dtype=np.float32),
            old_logp=None if old_logp is None else tuple(np.asarray(x, dtype=np.float32) for x in old_logp),
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def length(self, i: int) -> int:
        return len(self.prompts[i]) + len(self.responses[i])

    @property
    def num_response_tokens(self) -> int:
        return sum(len(r) for r in self.responses)

    @property
    def num_loss_tokens(self) -> int:
        """The tokens the loss averages over."""
        return self.num_response_tokens if self.loss_tokens is None else self.loss_tokens

    def with_update_inputs(self, advantages: Sequence[float], old_logp: Sequence[np.ndarray],
                           weights: Sequence[np.ndarray] | None = None, loss_tokens: int | None = None) -> Sequences:
        """These sequences with what `train_step` needs; `weights` and `loss_tokens`: see the fields."""
        out = Sequences.build(self.prompts, self.responses, advantages, old_logp)
        if weights is None:
            return out
        return dataclasses.replace(out, weights=tuple(np.asarray(w, dtype=np.float32) for w in weights),
                                   loss_tokens=loss_tokens)


@dataclass(frozen=True)
class MicroBatchPlan:
    """`ranks[r][m]`: the sequence indices rank r runs in its micro-batch m (may be empty)."""

    ranks: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0])


def plan_micro_batches(seqs: Sequences, world_size: int, max_tokens: int) -> MicroBatchPlan:
    """Longest sequences first onto the least-loaded rank; then per rank, micro-batches of at most
    `max_tokens` tokens (a longer sequence gets one to itself); every rank padded to the same count."""
    if world_size < 1:
        raise InputError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(seqs)), key=lambda i: (-seqs.length(i), i))
    loads = [(0, r) for r in range(world_size)]
    share: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, r = heapq.heappop(loads)
        share[r].append(i)
        heapq.heappush(loads, (load + seqs.length(i), r))
    cut = [_cut(sorted(s, key=lambda i: (-seqs.length(i), i)), seqs, max_tokens) for s in share]
    count = max(1, max(len(c) for c in cut))
    return MicroBatchPlan(tuple(tuple(c + [()] * (count - len(c))) for c in cut))


def _cut(indices: list[int], seqs: Sequences, max_tokens: int) -> list[tuple[int, ...]]:
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    for i in indices:
        n = seqs.length(i)
        if current and used + n > max_tokens:
            batches.append(tuple(current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(tuple(current))
    return batches
