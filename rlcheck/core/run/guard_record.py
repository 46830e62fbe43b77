"""The engine guard's record of one forward step, the cache pool it addresses, and a violation
(pure data; `rlcheck.engines.guard.checks` checks the invariants on it, `rlcheck.engines.guard`
fills it from vLLM).

A `StepRecord` holds, per request scheduled in the step (N rows, in the batch order the kernels see)
and per Mamba KV group (G columns): the state slot the kernels were told to use, the slot the block
table assigned, whether the kernels run the row as decode, and whether the row starts from the
slot's state (decode rows always do; prefill rows when vLLM's `has_initial_states_p` is True); per
attention KV group, the block table row of each request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

CHECKS = {
    "prefill_from_zero": "(i) a request with no computed tokens runs as prefill from a zero state",
    "slot_unique": "(ii) a live request uses its own state slot, used or held by no other live request",
    "in_pool": "(iii) slot and block ids lie within the cache pool",
    "offset_fits": "(iv) slot x stride fits the kernels' offset integer with room to spare",
    "freed_reinit": "(v) a freed slot is reinitialised before a new request reads it",
}
INVARIANT = {check: text.split(" ", 1)[0] for check, text in CHECKS.items()}  # check -> "(i)" .. "(v)"


class Ragged(NamedTuple):
    """Per-row lists of block ids, packed: row i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray  # (K,) int64
    offsets: np.ndarray  # (N + 1,) int64

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> Ragged:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        values = np.fromiter((b for r in rows for b in r), dtype=np.int64, count=int(offsets[-1]))
        return cls(values, offsets)


@dataclass(frozen=True)
class StepRecord:
    """One forward step as the kernels saw it (see the module docstring)."""

    step: int  # forward step of this engine since the guard was installed, from 1
    request_ids: tuple[str, ...]  # (N,) as `LLM.generate` reports them
    computed: np.ndarray  # (N,) int64 tokens computed before this step
    scheduled: np.ndarray  # (N,) int64 tokens scheduled in this step
    prompt_len: np.ndarray  # (N,) int64
    new: np.ndarray  # (N,) bool: (re)admitted in this step (a new request, or resumed after preemption)
    groups: tuple[int, ...] = ()  # (G,) Mamba KV group ids
    slot: np.ndarray | None = None  # (N, G) int64 the state slot the kernels were told to use
    assigned: np.ndarray | None = None  # (N, G) int64 the slot the block table holds for the request
    decode: np.ndarray | None = None  # (N, G) bool the kernels run the row as decode
    initial_state: np.ndarray | None = None  # (N, G) bool the row starts from the slot's state
    attn_groups: tuple[int, ...] = ()  # (A,) attention KV group ids
    blocks: tuple[Ragged, ...] = ()  # (A,) the block table rows of each attention group
    finished: tuple[str, ...] = ()  # requests finished since the previous step (their blocks freed)
    call_step: int | None = None  # the caller's step (`VLLMEngine.generate(step=...)`), if known

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    def phase(self, i: int) -> str:
        """"prefill" (from token 0), "chunked prefill" (a later prompt chunk) or "decode"."""
        computed = int(self.computed[i])
        if computed == 0:
            return "prefill"
        return "chunked prefill" if computed < int(self.prompt_len[i]) else "decode"

    def kernel_phase(self, i: int, g: int) -> str:
        if self.decode is None or self.decode.shape[1] == 0:
            return "-"
        if self.decode[i, g]:
            return "decode"
        return "prefill from state" if self.initial_state[i, g] else "prefill from zeros"


@dataclass(frozen=True)
class GroupOffsets:
    """How a KV group's kernels address one slot of its cache tensors (the worst tensor of the group):
    the element offset of a slot's last element is slot * stride + extent - 1."""

    stride: int  # elements between two slots (the tensor's stride 0)
    extent: int  # elements one slot spans (from the other dims' shapes and strides)
    itemsize: int
    layer: str  # a layer that has this tensor, for the report

    def end_offset(self, slot: int) -> int:
        return slot * self.stride + self.extent

    def max_safe_slot(self, bound: int) -> int:
        """The largest slot whose end offset stays at or under `bound` (elements)."""
        return (bound - self.extent) // self.stride if self.stride > 0 else 1 << 62


@dataclass(frozen=True)
class PoolInfo:
    """The engine's cache pool: its size and how each group's kernels address it."""

    num_blocks: int  # block ids 0 .. num_blocks - 1; 0 is vLLM's null block
    offsets: dict[int, GroupOffsets] = field(default_factory=dict)  # KV group id -> addressing
    unaddressed: tuple[int, ...] = ()
    """KV groups whose cache tensors have no dimension of num_blocks (on CUDA an attention cache split
    into kernel blocks): check (iv) does not run for them, and the guard's summary says so."""

    def to_dict(self, limit: int, margin: float) -> dict[str, Any]:
        bound = int(limit * margin)
        return {"num_blocks": self.num_blocks, "offset_limit": limit, "offset_margin": margin, "groups": {
            str(g): {"layer": o.layer, "stride": o.stride, "extent": o.extent, "itemsize": o.itemsize,
                     "pool_end_offset": o.end_offset(self.num_blocks - 1), "max_safe_slot": o.max_safe_slot(bound)}
            for g, o in self.offsets.items()},
            "offset_fits_not_run": [{"group": g, "why": "no cache dimension equals num_blocks (the cache is "
                                     "split into kernel blocks): offsets not known"} for g in self.unaddressed]}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which check, at which engine step, by which request, on which slot."""

    check: str  # a key of CHECKS
    step: int
    request_id: str
    message: str
    slot: int | None = None
    group: int | None = None
    others: tuple[str, ...] = ()  # the other requests involved (sharers, the previous writer)
    evidence: dict[str, Any] = field(default_factory=dict)
    call_step: int | None = None
    rollout_request_id: str | None = None  # the id `VLLMEngine` gave the rollout ("{engine}/s{step}/{id}")

    @property
    def invariant(self) -> str:
        return INVARIANT[self.check]

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "invariant": self.invariant, "step": self.step, "request_id": self.request_id,
                "slot": self.slot, "group": self.group, "others": list(self.others), "message": self.message,
                "evidence": self.evidence, "call_step": self.call_step, "rollout_request_id": self.rollout_request_id}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Violation:
        return cls(check=d["check"], step=int(d["step"]), request_id=str(d["request_id"]), message=d["message"],
                   slot=d.get("slot"), group=d.get("group"), others=tuple(d.get("others") or ()),
                   evidence=dict(d.get("evidence") or {}), call_step=d.get("call_step"),
                   rollout_request_id=d.get("rollout_request_id"))
