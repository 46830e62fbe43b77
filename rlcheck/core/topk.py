"""Beyond the sampled token: the engine's and the trainer's top-K logprobs at every response position.

A `TopK` is packed like `StepBatch`'s response tokens, one row per token (M rows, K columns):

    ids_rollout   (M, K) int64    the engine's top-K ids, by the engine's logprob descending
    logp_rollout  (M, K) float32  the engine's logprobs of those ids
    logp_train    (M, K) float32  the trainer's logprobs of the same ids (`ids_rollout`)
    ids_train     (M, K) int64    the trainer's own top-K ids, by its logprob descending

A row with fewer than K entries is padded with id -1 (logprob -inf); padding is ignored everywhere.
`from_engine_dicts` turns the engine's per-position {token_id: logprob} dicts into the first two
arrays; the trainer scores the rest from its logits. `rlcheck.core.stats` reads it (with
`StatsConfig.distribution`) into the `rlcheck/dist/*` metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from rlcheck.core.batch_build import float_array, int_array, to_numpy
from rlcheck.core.limits import MAX_LOGPROB
from rlcheck.errors import ConfigError, InputError

__all__ = ["PAD_ID", "TopK", "from_engine_dicts"]

PAD_ID = -1
"""The id of a padding entry (a row with fewer than K scored tokens)."""

_ID_FIELDS = ("ids_rollout", "ids_train")
_LOGP_FIELDS = ("logp_rollout", "logp_train")


@dataclass(frozen=True, eq=False)
class TopK:
    """Top-K ids and logprobs of M response tokens; see the module docstring for the layout."""

    ids_rollout: np.ndarray  # (M, K) int64
    logp_rollout: np.ndarray  # (M, K) float32
    logp_train: np.ndarray  # (M, K) float32
    ids_train: np.ndarray  # (M, K) int64

    def __post_init__(self) -> None:
        self._validate()

    @property
    def num_tokens(self) -> int:
        return int(self.ids_rollout.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids_rollout.shape[1])

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_packed(cls, ids_rollout: Any, logp_rollout: Any, logp_train: Any, ids_train: Any) -> TopK:
        """From (M, K) array-likes (numpy, torch on any device, lists): ids read as int64, logprobs as
        float32."""
        return cls(
            ids_rollout=int_array(ids_rollout, "topk.ids_rollout"),
            logp_rollout=float_array(logp_rollout, "topk.logp_rollout").astype(np.float32, copy=False),
            logp_train=float_array(logp_train, "topk.logp_train").astype(np.float32, copy=False),
            ids_train=int_array(ids_train, "topk.ids_train"),
        )

    @classmethod
    def from_ragged(
        cls,
        ids_rollout: Sequence[Any],
        logp_rollout: Sequence[Any],
        logp_train: Sequence[Any],
        ids_train: Sequence[Any],
    ) -> TopK:
        """From one (L_i, K) array per sequence for each field, concatenated in sequence order (the
        order of `StepBatch.from_ragged`'s sequences)."""
        parts = {"ids_rollout": ids_rollout, "logp_rollout": logp_rollout, "logp_train": logp_train,
                 "ids_train": ids_train}
        n = len(ids_rollout)
        for name, seqs in parts.items():
            if len(seqs) != n:
                raise InputError(f"topk.{name} has {len(seqs)} sequences, topk.ids_rollout has {n}")
        k = _ragged_k(ids_rollout)
        read = {name: [_rows(x, k, f"topk.{name}[{i}]") for i, x in enumerate(seqs)] for name, seqs in parts.items()}
        for i in range(n):
            lens = {name: read[name][i].shape[0] for name in parts}
            if len(set(lens.values())) != 1:
                raise InputError(f"topk sequence {i}: the fields have different lengths {lens}")
        return cls.from_packed(**{name: np.concatenate(arrs) if arrs else np.zeros((0, k)) for name, arrs in read.items()})

    # ---- rows ---------------------------------------------------------------------------------

    def take(self, rows: Any) -> TopK:
        """The given rows (token indices into the packed batch, or a boolean mask), in the given order."""
        rows = np.asarray(rows)
        return TopK(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    @classmethod
    def concat(cls, parts: Sequence[TopK]) -> TopK:
        """The rows of several `TopK`s back to back (all with the same K)."""
        if not parts:
            raise InputError("TopK.concat needs at least one TopK")
        if len({p.k for p in parts}) != 1:
            raise InputError(f"TopK.concat: the parts have different K {sorted({p.k for p in parts})}; "
                             "score every batch of a step with the same top-k")
        if len(parts) == 1:
            return parts[0]
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    # ---- validation ----------------------------------------------------------------------------

    def _validate(self) -> None:
        shape = self.ids_rollout.shape
        for name in _ID_FIELDS + _LOGP_FIELDS:
            a = getattr(self, name)
            if a.ndim != 2 or a.shape != shape:
                raise InputError(f"topk.{name} has shape {a.shape}; every TopK field is (M, K) like "
                                 f"topk.ids_rollout {shape}")
        if shape[1] < 1:
            raise InputError("topk: K is 0; pass at least one top-k column")
        for name in _ID_FIELDS:
            a = getattr(self, name)
            if a.dtype != np.int64:
                raise InputError(f"topk.{name} must be int64, got {a.dtype} (build with TopK.from_packed)")
            if a.size and a.min() < PAD_ID:
                i, j = np.argwhere(a < PAD_ID)[0]
                raise InputError(f"topk.{name}: id {int(a[i, j])} at token {i}, column {j}; ids are >= 0, "
                                 f"or {PAD_ID} for padding")
            _check_unique(a, name)
        for name in _LOGP_FIELDS:
            a = getattr(self, name)
            if a.dtype.kind != "f":
                raise InputError(f"topk.{name} must be floating point, got {a.dtype}")
            if a.size and not a.max() <= MAX_LOGPROB:  # NaN or +inf or a logit
                i, j = np.argwhere(~(a <= MAX_LOGPROB))[0]
                raise InputError(f"topk.{name}: value {float(a[i, j]):.4g} at token {i}, column {j}; "
                                 "top-k logprobs are <= 0 or -inf (no NaN): were logits or probabilities passed?")


def _check_unique(ids: np.ndarray, name: str) -> None:
    """Raise if a row names one token twice (padding aside): its probability would count twice."""
    if ids.shape[1] < 2 or not ids.size:
        return
    s = np.sort(ids, axis=1)  # (M, K)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] != PAD_ID)  # (M, K-1)
    if dup.any():
        i, j = np.argwhere(dup)[0]
        raise InputError(f"topk.{name}: token {int(s[i, j])} appears twice at token {i}; a top-k row "
                         "holds distinct ids")


def _ragged_k(ids_rollout: Sequence[Any]) -> int:
    """K from the first per-sequence array that is 2-D."""
    for x in ids_rollout:
        shape = np.shape(x) if not hasattr(x, "shape") else tuple(x.shape)
        if len(shape) == 2:
            return int(shape[1])
    raise InputError("topk.from_ragged: no (L, K) array to read K from; pass 2-D arrays per sequence")


def _rows(x: Any, k: int, name: str) -> np.ndarray:
    """One sequence's (L, K) array; an empty sequence may be given as []."""
    a = to_numpy(x, name)
    if a.size == 0:
        return a.reshape(0, k)
    if a.ndim != 2 or a.shape[1] != k:
        raise InputError(f"{name} has shape {a.shape}, expected (L, {k})")
    return a


def from_engine_dicts(top: Sequence[Mapping[int, Any] | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's per-position {token_id: logprob} dicts as (ids (L, K) int64, logp (L, K) float32).

    Keeps the k highest logprobs of each position (ties: the smaller id first), sorted descending, so
    the extra sampled token vLLM adds when it is not among its top-k is dropped; a position with fewer
    than k entries (or None) is padded with id -1 and logprob -inf. Values may be floats or objects
    with a `.logprob` (vLLM's `Logprob`)."""
    if not (isinstance(k, (int, np.integer)) and k >= 1):
        raise ConfigError(f"from_engine_dicts: k must be an integer >= 1, got {k!r}")
    num = len(top)
    counts = np.fromiter((len(d) if d else 0 for d in top), dtype=np.int64, count=num)  # (L,)
    total = int(counts.sum())
    ids = np.fromiter((t for d in top if d for t in d), dtype=np.int64, count=total)  # (E,)
    lps = np.fromiter((getattr(v, "logprob", v) for d in top if d for v in d.values()), dtype=np.float64,
                      count=total)  # (E,)
    pos = np.repeat(np.arange(num, dtype=np.int64), counts)  # (E,)
    order = np.lexsort((ids, -lps, pos))  # by position, then logprob descending, then id
    starts = np.repeat(np.cumsum(counts) - counts, counts)  # (E,) first entry of each position
    rank = np.arange(total, dtype=np.int64) - starts  # (E,) place within its position (pos is sorted)
    keep = rank < k
    out_ids = np.full((num, k), PAD_ID, dtype=np.int64)
    out_lp = np.full((num, k), -np.inf, dtype=np.float32)
    out_ids[pos[keep], rank[keep]] = ids[order][keep]
    out_lp[pos[keep], rank[keep]] = lps[order][keep]
    return out_ids, out_lp
