"""Mixture-of-experts routing agreement: do the engine and the trainer send each token to the same experts?

In an MoE a tiny numeric difference in a router's logits flips which experts a near-tie token goes
to, and then the two sides compute different functions of it: a logprob mismatch that no amount of
kernel matching removes. A `Routing` holds both sides' choices, packed like `StepBatch`'s tokens:

    experts_rollout  (M, L, k) int64  the engine's top-k experts of each response token at each MoE layer
    experts_train    (M, L, k) int64  the trainer's, from the forward that recomputed the logprobs

The order inside a top-k row does not matter: a token agrees at a layer when both sides picked the
same *set* of experts. `routing_metrics` reduces one step to the `rlcheck/moe/*` metrics; the math is
pure numpy (no torch, no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.correction import response_mask
from rlcheck.core.tally import Tally
from rlcheck.core.types import Alarm
from rlcheck.errors import InputError

__all__ = ["CONCENTRATION", "MIN_SHARE", "Routing", "RoutingStats", "batch_routing_metrics", "first_diff_layer",
           "routing_alarms", "routing_metrics", "routing_stats", "routing_tally", "same_experts", "sequence_routing",
           "tally_metrics"]

MIN_SHARE = 0.5
"""Routing drives a step's mismatch when the tokens routed differently carry at least this share of its
sum |d| ..."""
CONCENTRATION = 2.0
"""... and at least this many times their share of the tokens (bf16 router noise alone reroutes 0.2-1.6%
of the tokens of the tiny MoE, which carry 2-13% of sum |d|: BENCHMARKS.md, "MoE routing agreement")."""


@dataclass(frozen=True, eq=False)
class Routing:
    """Both sides' top-k experts of M response tokens at L MoE layers; see the module docstring."""

    experts_rollout: np.ndarray  # (M, L, k) int64
    experts_train: np.ndarray  # (M, L, k) int64

    def __post_init__(self) -> None:
        for name in ("experts_rollout", "experts_train"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        a, b = self.experts_rollout, self.experts_train
        if a.ndim != 3 or a.shape != b.shape:
            raise InputError(
                f"routing: experts_rollout {a.shape} and experts_train {b.shape} must both be "
                "(tokens, moe_layers, top_k); pass one row per response token from each side"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.experts_rollout.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts_rollout.shape[1])

    def check_tokens(self, num_tokens: int) -> None:
        """Raise InputError unless there is one routing row per response token of the batch."""
        if self.num_tokens != num_tokens:
            raise InputError(f"routing has {self.num_tokens} rows for {num_tokens} tokens (one row per token)")

    def metrics(self, diff: np.ndarray, mask: np.ndarray | None = None) -> dict[str, float]:
        """`routing_metrics(self, diff, mask)`: the step's `rlcheck/moe/*` metrics."""
        return routing_metrics(self, diff, mask)

    def take(self, rows: np.ndarray) -> Routing:
        """The routing of the given token rows (a `StepBatch.select`)."""
        return Routing(self.experts_rollout[rows], self.experts_train[rows])

    @classmethod
    def concat(cls, parts: Sequence[Routing]) -> Routing:
        """Several batches' routing, in order."""
        return cls(np.concatenate([p.experts_rollout for p in parts]), np.concatenate([p.experts_train for p in parts]))

    @classmethod
    def from_sequences(cls, rollout: Sequence[Any], train: Sequence[Any]) -> Routing:
        """From one (T_i, L, k) array per sequence on each side, packed in sequence order."""
        def pack(side: Sequence[Any]) -> np.ndarray:
            return np.concatenate([np.asarray(s, dtype=np.int64) for s in side]) if len(side) else np.zeros((0, 0, 0))

        return cls(pack(rollout), pack(train))


def same_experts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, L) bool: whether rows of `a` and `b` (M, L, k) hold the same expert *set*;
    naively `[[set(a[m, l]) == set(b[m, l]) for l] for m]`."""
    return (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1)


def first_diff_layer(agree: np.ndarray) -> np.ndarray:
    """(M,) int64 index of each token's first MoE layer whose experts differ, from `agree` (M, L);
    L (one past the last layer) where the token is routed alike at every layer."""
    num_layers = agree.shape[1]
    return np.where(agree.all(axis=1), num_layers, np.argmin(agree, axis=1)).astype(np.int64)


@dataclass(frozen=True)
class RoutingStats:
    """One step's routing agreement over the kept tokens."""

    num_tokens: int
    agree_frac: float
    """Tokens routed alike at *every* MoE layer, as a fraction of the tokens."""
    layer_agree_frac: tuple[float, ...]
    """Per MoE layer: the tokens routed alike there."""
    first_diff_counts: tuple[int, ...]
    """Per MoE layer: the tokens whose routing first differs there."""
    abs_diff_share: float
    """Share of the step's sum |d| carried by the tokens routed differently (0 when sum |d| is 0)."""
    abs_diff_lift: float
    """Mean |d| of the tokens routed differently over that of the tokens routed alike (NaN when
    either group is empty or the latter's mean is 0): >> 1 when rerouting drives the mismatch."""


def routing_stats(routing: Routing, diff: np.ndarray, mask: np.ndarray | None = None) -> RoutingStats:
    """Agreement of `routing` over the tokens `mask` (M,) keeps, and how |d| of `diff` (M,) splits between the
    tokens routed alike and the others."""
    keep = np.isfinite(diff)  # (M,) a new array: the caller's mask is evidence, never changed here
    if mask is not None:
        keep = keep & np.asarray(mask, dtype=bool)
    agree = same_experts(routing.experts_rollout, routing.experts_train)[keep]  # (n, L)
    d = np.abs(np.asarray(diff, dtype=np.float64)[keep])  # (n,)
    n, num_layers = agree.shape
    alike = agree.all(axis=1)  # (n,)
    first = first_diff_layer(agree)
    total = float(d.sum())
    moved, kept = d[~alike], d[alike]
    lift = float(moved.mean() / kept.mean()) if moved.size and kept.size and kept.mean() > 0 else float("nan")
    return RoutingStats(
        num_tokens=n,
        agree_frac=float(alike.mean()) if n else float("nan"),
        layer_agree_frac=tuple(float(x) for x in agree.mean(axis=0)) if n else (float("nan"),) * num_layers,
        first_diff_counts=tuple(int(c) for c in np.bincount(first, minlength=num_layers + 1)[:num_layers]),
        abs_diff_share=float(moved.sum() / total) if total > 0 else 0.0,
        abs_diff_lift=lift,
    )


def sequence_routing(routing: Routing, cu_seqlens: np.ndarray, mask: np.ndarray | None = None
                     ) -> tuple[np.ndarray, list[int | None]]:
    """Per sequence of `cu_seqlens` (N+1,): ((N,) the share of its tokens routed alike at every MoE layer,
    NaN without tokens; (N,) the first MoE layer where any of its tokens is routed differently, None where
    none is), over the tokens `mask` (M,) keeps; naively `[routing_stats(seq).agree_frac for seq]` and
    `min(first_diff_layer(seq))`."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    num, num_layers = cu.shape[0] - 1, routing.num_layers
    keep = np.ones(routing.num_tokens, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    seq = np.repeat(np.arange(num), np.diff(cu))  # (M,) sequence of each token
    agree = same_experts(routing.experts_rollout, routing.experts_train)  # (M, L)
    counted = np.bincount(seq[keep], minlength=num).astype(np.float64)
    alike = np.bincount(seq[keep], weights=agree.all(axis=1)[keep], minlength=num)
    frac = np.divide(alike, counted, out=np.full(num, np.nan), where=counted > 0)
    first = np.full(num, num_layers, dtype=np.int64)
    np.minimum.at(first, seq[keep], first_diff_layer(agree)[keep])
    return frac, [int(f) if f < num_layers else None for f in first]


def routing_metrics(routing: Routing, diff: np.ndarray, mask: np.ndarray | None = None) -> dict[str, float]:
    """The `rlcheck/moe/*` metrics of one step (`routing_stats`); an undefined metric is left out."""
    return tally_metrics(routing_tally(routing, diff, mask))


def routing_tally(routing: Routing, diff: np.ndarray, mask: np.ndarray | None = None) -> Tally:
    """The counts and sums the `rlcheck/moe/*` metrics are finalized from (`tally_metrics`), over the
    finite tokens `mask` (M,) keeps; the parts of a step held by several ranks add up."""
    keep = np.isfinite(diff) if mask is None else np.asarray(mask, dtype=bool) & np.isfinite(diff)  # a new array
    agree = same_experts(routing.experts_rollout, routing.experts_train)[keep]  # (n, L)
    d = np.abs(np.asarray(diff, dtype=np.float64)[keep])  # (n,)
    alike = agree.all(axis=1)  # (n,)
    firsts = np.bincount(first_diff_layer(agree), minlength=routing.num_layers + 1)
    sums = {"moe/tokens": float(agree.shape[0]), "moe/alike": float(alike.sum()), "moe/abs": float(d.sum()),
            "moe/moved_abs": float(d[~alike].sum()), "moe/alike_abs": float(d[alike].sum())}
    for layer in range(routing.num_layers):
        sums[f"moe/layer{layer}/agree"] = float(agree[:, layer].sum())
        sums[f"moe/layer{layer}/first"] = float(firsts[layer])
    return Tally(sums, maxima={"moe/layers": float(routing.num_layers)})


def tally_metrics(t: Tally) -> dict[str, float]:
    """The `rlcheck/moe/*` metrics of a (merged) `routing_tally`; {} without routing, the token count
    alone without a token."""
    s = t.sums
    if "moe/tokens" not in s:
        return {}
    n = s["moe/tokens"]
    if n == 0:
        return {K.MOE_TOKEN_COUNT: 0.0}
    alike, moved = s["moe/alike"], n - s["moe/alike"]
    out = {K.MOE_TOKEN_COUNT: n, K.MOE_ROUTE_AGREE_FRAC: alike / n,
           K.MOE_ABS_DIFF_SHARE: s["moe/moved_abs"] / s["moe/abs"] if s["moe/abs"] > 0 else 0.0}
    for layer in range(int(t.maxima["moe/layers"])):
        out[K.moe_layer_agree(layer)] = s[f"moe/layer{layer}/agree"] / n
        out[K.moe_first_diff(layer)] = s[f"moe/layer{layer}/first"]
    if moved and alike and s["moe/alike_abs"] > 0:
        out[K.MOE_ABS_DIFF_LIFT] = (s["moe/moved_abs"] / moved) / (s["moe/alike_abs"] / alike)
    return out


def batch_routing_metrics(batch: Any, keep: np.ndarray | None = None) -> dict[str, float]:
    """`routing_metrics` of a StepBatch's routing over the compared tokens (`response_mask`) of the
    sequences `keep` (N,) keeps (the quarantine's verdict; all when None); {} without routing."""
    if batch is None or batch.routing is None:
        return {}
    return routing_metrics(batch.routing, batch.logp_train - batch.logp_rollout, response_mask(batch, keep))


def routing_alarms(step: int, metrics: Mapping[str, float]) -> list[Alarm]:
    """A warning when the step's tokens routed differently carry its mismatch (`MIN_SHARE`,
    `CONCENTRATION`) from its `rlcheck/moe/*` metrics; none without them."""
    share, agree = metrics.get(K.MOE_ABS_DIFF_SHARE), metrics.get(K.MOE_ROUTE_AGREE_FRAC)
    if share is None or agree is None or agree >= 1.0 or share < max(MIN_SHARE, CONCENTRATION * (1.0 - agree)):
        return []
    message = (f"{1.0 - agree:.1%} of the tokens went to other experts in the engine than in the trainer and "
               f"carry {share:.0%} of the summed |d|: routing differs between the two sides")
    return [Alarm("threshold", K.MOE_ABS_DIFF_SHARE, step, "warn", message,
                  {"value": share, "route_agree_frac": agree, "limit": MIN_SHARE})]
