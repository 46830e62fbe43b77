"""Wraps of one engine's `sync_weights`, stacked and removed one at a time: how the engine faults
that act at a weight sync (stale-buffer, stale-prefix-cache, perturb-layer) hook it.

    wrap = wrap_sync(engine, around)    # around(sync, named_tensors, version) calls sync(...) inside
    engine.sync_weights(weights, 3)     # the newest wrap outermost, the engine's own sync innermost
    wrap.remove()                       # only this wrap goes, whatever was installed after it

While any wrap is on, the engine instance holds one `sync_weights` attribute, a `SyncChain`, which
calls the wraps in order; the last `remove()` deletes it, so the class's own method runs again. No
class is patched. The object-store and the collective syncs both go through `sync_weights`
(`rlcheck.engines.vllm_collective.Buckets`), so a wrap acts after either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Around = Callable[[Callable[[Any, int], Any], Any, int], Any]
"""around(sync, named_tensors, version): the wrap's sync; `sync(named_tensors, version)` is the next one in."""


class SyncChain:
    """The wraps on one engine's `sync_weights`, oldest first; called as the engine's `sync_weights`."""

    def __init__(self, engine: Any):
        self.engine, self.wraps = engine, []
        self.inner = engine.sync_weights  # the engine's own (bound) sync, or a wrap set some other way
        self.foreign = engine.__dict__.get("sync_weights")  # that other wrap, put back after the last remove

    def __call__(self, named_tensors: Any, version: int) -> Any:
        return self._call(list(self.wraps), named_tensors, version)

    def _call(self, wraps: list[SyncWrap], named_tensors: Any, version: int) -> Any:
        if not wraps:
            return self.inner(named_tensors, version)
        outer, rest = wraps[-1], wraps[:-1]
        return outer.around(lambda tensors, v: self._call(rest, tensors, v), named_tensors, version)


class SyncWrap:
    """One wrap on a `SyncChain`; `remove()` takes it (and only it) out, idempotent."""

    def __init__(self, chain: SyncChain, around: Around):
        self.chain, self.around = chain, around

    @property
    def active(self) -> bool:
        return self in self.chain.wraps

    def remove(self) -> None:
        chain = self.chain
        if self in chain.wraps:
            chain.wraps.remove(self)
        if not chain.wraps and chain.engine.__dict__.get("sync_weights") is chain:
            chain.engine.__dict__.pop("sync_weights")
            if chain.foreign is not None:
                chain.engine.sync_weights = chain.foreign


def wrap_sync(engine: Any, around: Around) -> SyncWrap:
    """Put `around` outermost on `engine.sync_weights` (see the module docstring)."""
    chain = engine.__dict__.get("sync_weights")
    if not isinstance(chain, SyncChain):
        chain = SyncChain(engine)
        engine.sync_weights = chain
    wrap = SyncWrap(chain, around)
    chain.wraps.append(wrap)
    return wrap
