"""The five lifecycle invariants the engine guard checks on each forward step (pure: a
`StepRecord` in, `Violation`s out; see `rlcheck.core.run.guard_record` for the record):

(i)   prefill_from_zero  a request with no computed tokens runs as prefill from a zero state
(ii)  slot_unique        a live request uses its own slot: the one assigned, used or held by no other
(iii) in_pool            slot and block ids lie in the pool (Mamba slots past the null block 0)
(iv)  offset_fits        slot x stride (+ the slot's extent) stays under margin x the offset limit
(v)   freed_reinit       a request reads only state it wrote (a freed slot is reinitialised first)

Each check reports at most one violation per request and step, naming the request, step and slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core.run.guard_record import PoolInfo, StepRecord, Violation


def _violation(rec: StepRecord, check: str, i: int, message: str, **kw: Any) -> Violation:
    evidence = {"phase": rec.phase(i), "computed": int(rec.computed[i]), "scheduled": int(rec.scheduled[i]),
                "prompt_len": int(rec.prompt_len[i]), **kw.pop("evidence", {})}
    return Violation(check, rec.step, rec.request_ids[i], f"step {rec.step}: request {rec.request_ids[i]} {message}",
                     evidence=evidence, call_step=rec.call_step, **kw)


# ---- (i) to (iv): one step at a time -------------------------------------------------------------


def check_prefill_from_zero(rec: StepRecord) -> list[Violation]:
    """(i) Rows with no computed tokens that the Mamba kernels run as decode, or as a prefill that
    starts from the slot's state: vLLM's decode-before-prefill bug, and the stale-state shape."""
    if not rec.groups:
        return []
    bad = (rec.computed == 0)[:, None] & (rec.decode | rec.initial_state)  # (N, G)
    out = []
    for i in np.flatnonzero(bad.any(axis=1)):
        g = int(np.flatnonzero(bad[i])[0])
        how = "as decode" if rec.decode[i, g] else "as a prefill from the slot's old state (has_initial_state True)"
        out.append(_violation(rec, "prefill_from_zero", i,
                              f"has no computed tokens but ran {how} in state slot {rec.slot[i, g]} "
                              f"(Mamba group {rec.groups[g]}), not from zeros",
                              slot=int(rec.slot[i, g]), group=rec.groups[g],
                              evidence={"kernel": rec.kernel_phase(i, g), "groups_affected": int(bad[i].sum())}))
    return out


def _block_users(rec: StepRecord) -> dict[int, set[int]]:
    """Block id -> rows that use it (Mamba slot told), hold it (Mamba slot assigned) or hold it in an
    attention block table; the null block 0 is left out (in_pool reports it). Attention blocks shared
    by a prefix-cache hit are legitimate, so only the Mamba slots are looked up in this map."""
    users: dict[int, set[int]] = {}
    for arr in (rec.slot, rec.assigned):
        for i, row in enumerate(arr.tolist()):
            for b in row:
                if b > 0:
                    users.setdefault(b, set()).add(i)
    for rag in rec.blocks:
        for i in range(rec.num_reqs):
            for b in rag.row(i).tolist():
                if b > 0:
                    users.setdefault(b, set()).add(i)
    return users


def check_slot_unique(rec: StepRecord) -> list[Violation]:
    """(ii) A Mamba slot told to a row must be the one assigned to it, and no other live request of
    the step may use or hold that block (in any group: the groups overlay one pool)."""
    if not rec.groups:
        return []
    used = set(rec.slot.ravel().tolist())
    if (len(used) == rec.slot.size and (rec.slot == rec.assigned).all()
            and not any(used.intersection(r.values.tolist()) for r in rec.blocks)):
        return []  # the common case: every slot its own, none in an attention table
    users = _block_users(rec)
    out = []
    for i in range(rec.num_reqs):
        for g in range(len(rec.groups)):
            s, a = int(rec.slot[i, g]), int(rec.assigned[i, g])
            sharers = sorted({rec.request_ids[j] for j in users.get(s, ()) if j != i})
            if not sharers and s == a:
                continue
            what = [] if s == a else [f"its layers were told slot {s}, the block table assigned it {a}"]
            if sharers:
                what.append(f"slot {s} is also used or held by live request(s) {', '.join(sharers[:5])}"
                            + (f" +{len(sharers) - 5}" if len(sharers) > 5 else ""))
            out.append(_violation(rec, "slot_unique", i, f"shares Mamba state (group {rec.groups[g]}): "
                                  + "; ".join(what), slot=s, group=rec.groups[g], others=tuple(sharers),
                                  evidence={"assigned": a, "kernel": rec.kernel_phase(i, g)}))
            break  # one report per request and step
    return out


def check_in_pool(rec: StepRecord, pool: PoolInfo) -> list[Violation]:
    """(iii) Mamba slots (told and assigned) in [1, num_blocks); attention block ids in [0, num_blocks)."""
    out, n = [], pool.num_blocks
    mamba_ok = not rec.groups or all(((a >= 1) & (a < n)).all() for a in (rec.slot, rec.assigned))
    if mamba_ok and all(((r.values >= 0) & (r.values < n)).all() for r in rec.blocks):
        return []
    for i in range(rec.num_reqs):
        bad: tuple[int, int, str] | None = None
        for g in range(len(rec.groups)):
            for s in (int(rec.slot[i, g]), int(rec.assigned[i, g])):
                if not 1 <= s < n:
                    bad = bad or (s, rec.groups[g], f"Mamba state slot {s} (group {rec.groups[g]})")
        for a, rag in zip(rec.attn_groups, rec.blocks, strict=True):
            row = rag.row(i)
            outside = row[(row < 0) | (row >= n)]
            if outside.size:
                bad = bad or (int(outside[0]), a, f"attention block {int(outside[0])} (group {a})")
        if bad is not None:
            out.append(_violation(rec, "in_pool", i, f"addresses {bad[2]}, outside the pool of {n} blocks "
                                  f"(valid: 1..{n - 1} for state slots, 0 being the null block)",
                                  slot=bad[0], group=bad[1], evidence={"num_blocks": n}))
    return out


def check_offset_fits(rec: StepRecord, pool: PoolInfo, limit: int, margin: float) -> list[Violation]:
    """(iv) The end offset (elements) of every slot a row addresses, slot * stride + extent, stays
    at or under margin * limit (limit 2**31: a signed 32-bit offset)."""
    bound = int(limit * margin)
    safe = {g: o.max_safe_slot(bound) for g, o in pool.offsets.items()}
    if all(rec.slot[:, g].max(initial=0) <= safe.get(gid, 1 << 62) for g, gid in enumerate(rec.groups)) and all(
            r.values.max(initial=0) <= safe.get(gid, 1 << 62) for gid, r in zip(rec.attn_groups, rec.blocks, strict=True)):
        return []
    out = []
    for i in range(rec.num_reqs):
        worst: tuple[int, int] | None = None  # (slot, group)
        for g, gid in enumerate(rec.groups):
            if gid in pool.offsets:
                s = int(rec.slot[i, g])
                if s > pool.offsets[gid].max_safe_slot(bound) and (worst is None or s > worst[0]):
                    worst = (s, gid)
        for gid, rag in zip(rec.attn_groups, rec.blocks, strict=True):
            row = rag.row(i)
            if gid in pool.offsets and row.size and int(row.max()) > pool.offsets[gid].max_safe_slot(bound):
                worst = worst or (int(row.max()), gid)
        if worst is not None:
            o = pool.offsets[worst[1]]
            end = o.end_offset(worst[0])
            out.append(_violation(
                rec, "offset_fits", i, f"addresses slot {worst[0]} of {o.layer}: offset {worst[0]} x {o.stride} + "
                f"{o.extent} = {end:,} elements ({end * o.itemsize:,} bytes), past {margin:g} x {limit:,}",
                slot=worst[0], group=worst[1],
                evidence={"end_offset": end, "end_offset_bytes": end * o.itemsize, "limit": limit, "margin": margin,
                          "stride": o.stride, "layer": o.layer}))
    return out


# ---- (v): across steps ---------------------------------------------------------------------------


class SlotHistory:
    """Who last wrote each state slot, and who freed it: the memory behind check (v)."""

    def __init__(self) -> None:
        self.writers: dict[int, tuple[str | frozenset[str], int]] = {}  # slot -> (request(s), step) of the last write
        self.freed: dict[int, tuple[str, int]] = {}  # slot -> (request, step) that released it
        self.slots_of: dict[str, tuple[int, ...]] = {}  # live request -> its slots at its last step

    def check(self, rec: StepRecord) -> list[Violation]:
        """(v) Rows that start from a slot's state (decode, or prefill with initial state) although
        the slot was last written by another request. Allowed: a request admitted in this step with
        computed tokens (its state comes from the prefix cache), and a request whose slot just moved
        (vLLM's align mode copies the state into the next block before the step)."""
        self._release(rec)
        if not rec.groups:
            return []
        out, slots, init = [], rec.slot.tolist(), rec.initial_state.tolist()
        readmitted = (rec.new & (rec.computed > 0)).tolist()
        for i, rid in enumerate(rec.request_ids):
            before = self.slots_of.get(rid)
            for g, s in enumerate(slots[i]):
                last = self.writers.get(s)
                if (not init[i][g] or readmitted[i] or last is None or _wrote(last[0], rid)
                        or (before is not None and before[g] != s)):
                    continue
                out.append(self._violation(rec, i, g, last))
                break
        return out

    def _violation(self, rec: StepRecord, i: int, g: int, last: tuple[str | frozenset[str], int]) -> Violation:
        s = int(rec.slot[i, g])
        freed = self.freed.get(s)
        freed = freed if freed is not None and freed[1] > last[1] else None  # released after that write
        writers = (last[0],) if isinstance(last[0], str) else tuple(sorted(last[0]))
        how = "decodes from" if rec.decode[i, g] else "starts its prefill from"
        note = f"; {freed[0]} released it at step {freed[1]}" if freed else ""
        return _violation(rec, "freed_reinit", i, f"{how} state slot {s} (group {rec.groups[g]}), last written by "
                          f"{', '.join(writers[:3])} at step {last[1]} and never reinitialised{note}",
                          slot=s, group=rec.groups[g], others=writers,
                          evidence={"written_at": last[1], "freed_by": freed[0] if freed else None,
                                    "freed_at": freed[1] if freed else None, "kernel": rec.kernel_phase(i, g)})

    def update(self, rec: StepRecord) -> None:
        """Every slot a row used is now written by the rows that used it in this step."""
        if not rec.groups:
            return
        step, slots = rec.step, rec.slot.tolist()
        for rid, row in zip(rec.request_ids, slots, strict=True):
            self.slots_of[rid] = tuple(row)
            for s in row:
                self.writers[s] = (rid, step)
        if len({s for row in slots for s in row}) < rec.slot.size:  # rows sharing a slot all wrote it
            by_slot: dict[int, set[str]] = {}
            for rid, row in zip(rec.request_ids, slots, strict=True):
                for s in row:
                    by_slot.setdefault(s, set()).add(rid)
            self.writers.update({s: (frozenset(r), step) for s, r in by_slot.items() if len(r) > 1})

    def _release(self, rec: StepRecord) -> None:
        for rid in rec.finished:
            for s in self.slots_of.pop(rid, ()):
                self.freed[s] = (rid, rec.step)


def _wrote(writers: str | frozenset[str], rid: str) -> bool:
    return writers == rid if isinstance(writers, str) else rid in writers


class InvariantChecker:
    """All five checks over a stream of step records (the guard runs one per engine)."""

    def __init__(self, pool: PoolInfo, offset_limit: int = 2**31, offset_margin: float = 0.5):
        self.pool, self.offset_limit, self.offset_margin = pool, offset_limit, offset_margin
        self.history = SlotHistory()

    def check(self, rec: StepRecord) -> list[Violation]:
        """The step's violations, in CHECKS order; the slot history then takes the step in."""
        out = check_prefill_from_zero(rec) + check_slot_unique(rec) + check_in_pool(rec, self.pool)
        out += check_offset_fits(rec, self.pool, self.offset_limit, self.offset_margin)
        out += self.history.check(rec)
        self.history.update(rec)
        return out
