"""What `StepBatch`'s constructors read: the caller's arrays checked and packed into its layout.

Any array-like (numpy, torch on any device, a list) is read as numpy of the kind a field needs
(float logprobs, int64 ids and offsets, a bool mask), request ids are checked to be present and
unique, and the two layouts callers hold are packed into 1-D token arrays with int64 `cu_seqlens`:
ragged (one array per sequence, `packed_from_ragged`) and padded ([B, T] arrays with a response mask,
`packed_from_padded`). Every problem raises `rlcheck.errors.InputError` naming it; the batch itself
(`rlcheck.core.batch.StepBatch`) then validates the packed result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.errors import InputError


def segment_token_indices(starts: Any, lens: Any) -> np.ndarray:
    """(sum(lens),) int64 indices of the tokens of segments [starts[i], starts[i] + lens[i]), in order;
    equal to `np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])`, without the loop.
    All offset arithmetic is int64, so offsets past 2**32 do not wrap."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)  # (N,) each
    offs = np.zeros(lens.shape[0] + 1, dtype=np.int64)  # (N+1,) where segment i lands in the output
    np.cumsum(lens, out=offs[1:])
    return np.repeat(starts - offs[:-1], lens) + np.arange(offs[-1], dtype=np.int64)


def to_numpy(x: Any, name: str) -> np.ndarray:
    """Any array-like (numpy, torch on any device, list) as a numpy array, without copying numpy."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch.Tensor, imported lazily by whoever made it
        t = x.detach()
        if t.dtype.is_floating_point and t.dtype.itemsize < 4:  # bf16/fp16 have no numpy twin
            t = t.float()
        return t.cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name}: cannot be read as an array ({exc})") from None


def float_array(x: Any, name: str) -> np.ndarray:
    """Logprobs as a float32 or float64 array (half precision widened to float32)."""
    a = to_numpy(x, name)
    if a.dtype.kind != "f":
        raise InputError(
            f"{name}: expected floating-point logprobs, got dtype {a.dtype}; "
            "pass the per-token log-probabilities as float32 or float64"
        )
    if a.dtype.itemsize < 4:
        a = a.astype(np.float32)
    return a


def _address(x: Any) -> int | None:
    """The first element's address of a torch tensor or a numpy array, None for anything else."""
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    return int(x.ctypes.data) if isinstance(x, np.ndarray) else None


def same_storage(a: Any, b: Any) -> bool:
    """True when `a` and `b` are one buffer: the same object, arrays sharing memory, or tensors (or a
    tensor and its numpy view) at the same address with the same shape."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.size > 0 and np.shares_memory(a, b)
    address = _address(a)
    return address is not None and address == _address(b) and tuple(a.shape) == tuple(b.shape) and address != 0


def two_sides(logp_rollout: Any, logp_train: Any, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Both sides' logprobs as float arrays (`float_array`); one buffer passed as both is an InputError:
    the trainer side would be the rollout side itself (verl's bypass mode hands `old_log_probs =
    rollout_log_probs`), and no step of it could ever show a mismatch."""
    if same_storage(logp_rollout, logp_train):
        raise InputError(
            f"logp_train{where} is logp_rollout{where} itself (one buffer passed as both sides): the trainer "
            "side must be the trainer's own recompute of the sampled tokens, or there is no mismatch to measure "
            "(verl: turn algorithm.rollout_correction.bypass_mode off)")
    return float_array(logp_rollout, f"logp_rollout{where}"), float_array(logp_train, f"logp_train{where}")


def int_array(x: Any, name: str) -> np.ndarray:
    """Token ids or offsets as an int64 array."""
    a = to_numpy(x, name)
    if a.size == 0:  # [] reads as float64
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise InputError(f"{name}: expected integer values, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def bool_array(x: Any, name: str) -> np.ndarray:
    """A mask (booleans, or integers 0/1) as a bool array."""
    a = to_numpy(x, name)
    if a.dtype.kind == "b" or a.size == 0:
        return a.astype(bool, copy=False)
    if a.dtype.kind in "iu":
        if a.size and (a.min() < 0 or a.max() > 1):
            raise InputError(f"{name}: a mask holds 0/1 or booleans, found values outside [0, 1]")
        return a.astype(bool)
    raise InputError(f"{name}: expected a boolean (or 0/1) mask, got dtype {a.dtype}")


def version_array(x: Any, num_sequences: int) -> np.ndarray:
    """Per-sequence weight versions as an (N,) int64 array: one integer for every sequence, or one
    per sequence; each a non-negative integer."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        a = np.full(num_sequences, int(x), dtype=np.int64)
    else:
        a = int_array(x, "weight_version").reshape(-1)
    if a.shape[0] != num_sequences:
        raise InputError(f"weight_version has {a.shape[0]} entries for {num_sequences} sequences")
    if (a < 0).any():
        raise InputError(f"weight_version must be non-negative, got {int(a.min())}")
    return a


def request_id_tuple(ids: Any, num_sequences: int) -> tuple[str, ...]:
    """One present, unique string id per sequence (integers are accepted and turned into strings)."""
    if ids is None:
        raise InputError(
            "request_ids is required: pass the engine's request id of every sequence, "
            "so that offenders and dumps can name the guilty requests"
        )
    if isinstance(ids, str):
        raise InputError("request_ids: expected a sequence of strings, got a single string")
    ids = list(to_numpy(ids, "request_ids").tolist()) if hasattr(ids, "detach") else list(ids)
    if len(ids) != num_sequences:
        raise InputError(f"request_ids: {len(ids)} ids for {num_sequences} sequences")
    out = []
    for i, rid in enumerate(ids):
        if rid is None or (isinstance(rid, str) and not rid):
            raise InputError(f"request_ids[{i}] is missing (None or empty)")
        if not isinstance(rid, (str, int, np.integer)):
            raise InputError(f"request_ids[{i}]: expected a string, got {type(rid).__name__}")
        out.append(str(rid))
    if len(set(out)) != len(out):
        seen: set[str] = set()
        dup = next(r for r in out if r in seen or seen.add(r))
        raise InputError(
            f"request_ids: {dup!r} appears more than once; every sampled sequence needs its own id "
            "(for G samples of one prompt, append the sample index)"
        )
    return tuple(out)


def packed_from_ragged(
    logp_rollout: Sequence[Any],
    logp_train: Sequence[Any],
    tokens: Sequence[Any] | None,
    mask: Sequence[Any] | None,
    tokens_train: Sequence[Any] | None,
) -> dict[str, np.ndarray | None]:
    """The per-token fields of one array per sequence, concatenated, and their `cu_seqlens`: the
    keyword arguments of `StepBatch.from_packed` (logp_rollout, logp_train, cu_seqlens, mask, tokens,
    tokens_train)."""
    if isinstance(logp_rollout, np.ndarray) or hasattr(logp_rollout, "detach"):
        raise InputError("from_ragged takes a list of per-sequence arrays; use from_packed or from_padded")
    n = len(logp_rollout)
    if n == 0:
        raise InputError("empty batch: no sequences to compare")
    if len(logp_train) != n:
        raise InputError(f"logp_train has {len(logp_train)} sequences, logp_rollout has {n}")
    sides = [two_sides(a, b, f"[{i}]") for i, (a, b) in enumerate(zip(logp_rollout, logp_train, strict=True))]
    rollout = [a.reshape(-1) for a, _ in sides]
    train = [b.reshape(-1) for _, b in sides]
    lens = np.fromiter((x.shape[0] for x in rollout), dtype=np.int64, count=n)  # (N,)
    for i, (a, b) in enumerate(zip(rollout, train, strict=True)):
        if a.shape != b.shape:
            raise InputError(f"sequence {i}: logp_rollout has {a.shape[0]} tokens, logp_train has {b.shape[0]}")
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])

    def cat(parts: Sequence[Any] | None, name: str, conv) -> np.ndarray | None:
        if parts is None:
            return None
        if len(parts) != n:
            raise InputError(f"{name} has {len(parts)} sequences, logp_rollout has {n}")
        arrs = [conv(p, f"{name}[{i}]").reshape(-1) for i, p in enumerate(parts)]
        for i, a in enumerate(arrs):
            if a.shape[0] != lens[i]:
                raise InputError(f"sequence {i}: {name} has {a.shape[0]} entries for {lens[i]} tokens")
        return np.concatenate(arrs) if arrs else np.zeros(0)

    dtype = np.result_type(*(x.dtype for x in rollout + train if x.size)) if lens.any() else np.float32
    return {
        "logp_rollout": np.concatenate(rollout).astype(dtype, copy=False),
        "logp_train": np.concatenate(train).astype(dtype, copy=False),
        "cu_seqlens": cu,
        "mask": cat(mask, "mask", bool_array),
        "tokens": cat(tokens, "tokens", int_array),
        "tokens_train": cat(tokens_train, "tokens_train", int_array),
    }


def padded_spans(mask: np.ndarray) -> np.ndarray:
    """(B, T) bool: the positions of a [B, T] `mask` that `packed_from_padded` packs, row b from its
    first to its last masked-in token (none for a row without one): where each packed token lies."""
    t = mask.shape[1]
    any_in = mask.any(axis=1)
    first = np.where(any_in, mask.argmax(axis=1), 0)  # (B,)
    last = np.where(any_in, t - 1 - mask[:, ::-1].argmax(axis=1), -1)  # (B,)
    cols = np.arange(t, dtype=np.int64)
    return (cols >= first[:, None]) & (cols <= last[:, None])


def packed_from_padded(
    logp_rollout: Any, logp_train: Any, mask: Any, tokens: Any, tokens_train: Any, topk: Any = None
) -> dict[str, Any]:
    """The per-token fields of [B, T] arrays, row b kept from its first to its last masked-in token
    (masked-out tokens inside that span stay, as masked tokens), and their `cu_seqlens`: the keyword
    arguments of `StepBatch.from_packed`, as `packed_from_ragged` returns them (and `topk`, a
    `rlcheck.core.topk.TopK` of B*T rows, with the kept rows)."""
    lr, lt = two_sides(logp_rollout, logp_train)
    m = bool_array(mask, "mask")
    if lr.ndim != 2:
        raise InputError(f"from_padded expects [B, T] arrays, logp_rollout has shape {lr.shape}")
    for name, a in (("logp_train", lt), ("mask", m)):
        if a.shape != lr.shape:
            raise InputError(f"{name} has shape {a.shape}, logp_rollout has shape {lr.shape}")
    if lr.shape[0] == 0:
        raise InputError("empty batch: no sequences to compare")
    b, t = lr.shape
    keep = padded_spans(m)  # (B, T)
    lens = keep.sum(axis=1, dtype=np.int64)
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])

    def pick(x: Any, name: str) -> np.ndarray | None:
        if x is None:
            return None
        a = int_array(x, name)
        if a.shape != lr.shape:
            raise InputError(f"{name} has shape {a.shape}, logp_rollout has shape {lr.shape}")
        return a[keep]

    return {
        "logp_rollout": lr[keep],
        "logp_train": lt[keep],
        "cu_seqlens": cu,
        "mask": m[keep],
        "tokens": pick(tokens, "tokens"),
        "tokens_train": pick(tokens_train, "tokens_train"),
        "topk": None if topk is None else _padded_topk(topk, b * t, keep),
    }


def _padded_topk(topk: Any, rows: int, keep: np.ndarray) -> Any:
    """The kept rows of a TopK of the B*T padded positions (row-major)."""
    if topk.num_tokens != rows:
        raise InputError(f"topk has {topk.num_tokens} rows; from_padded takes one per [B, T] position ({rows})")
    return topk.take(np.flatnonzero(keep.reshape(-1)))
