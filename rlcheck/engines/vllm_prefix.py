"""The `stale-prefix-cache` fault inside a rollout engine: its weight syncs leave vLLM's prefix cache
as it was, so a prompt that shares cached blocks with an earlier one is continued from the keys and
values the old weights computed (vLLM 0.32: `reload_weights` does not touch the cache; only
`LLM.reset_prefix_cache()`, which `rlcheck.engines.vllm_collective.load_buckets` calls after every
sync, drops it).

    handle = keep_prefix_cache(engine, start=1)   # syncs to version >= 1 keep the cache
    handle.kept                                   # syncs that kept it so far
    handle.remove()

Wraps that engine instance's `sync_weights` (`rlcheck.engines.sync_wraps`: the object-store and the
collective syncs both go through it); during a wrapped sync the `LLM` instance's `reset_prefix_cache` answers True and does
nothing. No class is patched.
"""

from __future__ import annotations

from typing import Any


class KeptPrefixCache:
    """See the module docstring."""

    def __init__(self, engine: Any, start: int = 1):
        from rlcheck.engines.sync_wraps import wrap_sync

        self.engine, self.start = engine, start
        self.kept = 0
        self.wrap = wrap_sync(engine, self._around)

    def _around(self, sync: Any, named_tensors: Any, version: int) -> None:
        if version < self.start:
            return sync(named_tensors, version)
        llm = self.engine.llm
        llm.reset_prefix_cache = _no_reset
        try:
            sync(named_tensors, version)
        finally:
            del llm.reset_prefix_cache
        self.kept += 1

    def remove(self) -> None:
        self.wrap.remove()


def _no_reset(*args: Any, **kwargs: Any) -> bool:
    return True


def keep_prefix_cache(engine: Any, start: int = 1) -> KeptPrefixCache:
    """Install the `stale-prefix-cache` fault on a `VLLMEngine`: syncs to weight version >= `start`
    keep the prefix cache (see the module docstring)."""
    return KeptPrefixCache(engine, start)
