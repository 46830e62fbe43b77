"""Scheduler context of each request of a stress run, from the vLLM slot trace (pure: events in,
dataclasses out). `rlcheck.engines.vllm_faults` records one `SlotEvent` per request, Mamba KV group
and engine step: the state block vLLM assigned, the block the layers were told to use (they differ
under an index-wrap fault) and, on a request's first prefill, the request that held the block before.
Per request that gives its batch (first step), its block, whether the block was reused (stale state
needs a previous holder) and who else used the same block in the same step (aliasing: two live
requests reading and writing one state).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SlotContext:
    """One request as the scheduler saw it (None where the engine gave no trace)."""

    arrival: int  # position in submission order
    first_step: int | None = None  # engine step of its first prefill: its batch
    last_step: int | None = None
    batch_size: int | None = None  # requests in that first step
    block: int | None = None  # state block vLLM assigned (first Mamba group)
    block_used: int | None = None  # the block its layers were told to use
    previous: str | None = None  # who held the block before its first prefill
    shared_with: tuple[str, ...] = ()  # live requests that used the same block in the same step

    @property
    def slot_reused(self) -> bool | None:
        return None if self.block is None else self.previous is not None


def id_key(request_id: str) -> tuple[int, str]:
    """Numeric ids in numeric order, others after them."""
    return (int(request_id), "") if request_id.isdigit() else (1 << 62, request_id)


def slot_context(events: Sequence[Any], request_ids: Sequence[str]) -> list[SlotContext]:
    """Per request id (in the given, arrival, order), its context from the fault hook's `SlotEvent`s."""
    from rlcheck.engines.vllm_faults import external_id

    by_request: dict[str, list[Any]] = defaultdict(list)
    users: dict[tuple[int, int], set[str]] = defaultdict(set)  # (step, block used) -> requests
    in_step: dict[int, set[str]] = defaultdict(set)
    for e in events:
        rid = external_id(e.request_id)
        by_request[rid].append(e)
        users[(e.step, e.used)].add(rid)
        in_step[e.step].add(rid)
    out = []
    for arrival, rid in enumerate(request_ids):
        evs = by_request.get(rid)
        if not evs:
            out.append(SlotContext(arrival))
            continue
        first = min(evs, key=lambda e: (e.step, e.group))
        previous = next((e.previous for e in evs if e.previous is not None), None)
        shared = {o for e in evs for o in users[(e.step, e.used)]} - {rid}
        out.append(SlotContext(
            arrival=arrival, first_step=first.step, last_step=max(e.step for e in evs),
            batch_size=len(in_step[first.step]), block=first.block, block_used=first.used,
            previous=None if previous is None else external_id(previous),
            shared_with=tuple(sorted(shared, key=id_key)),
        ))
    return out
