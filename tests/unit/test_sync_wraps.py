"""Wraps of an engine's `sync_weights` (`rlcheck.engines.sync_wraps`): stacked faults, removed one at a
time, each leaving the others on."""

from __future__ import annotations

import pytest

from rlcheck.engines.sync_wraps import SyncChain, wrap_sync


class LLM:
    """What the faults ask of a `vllm.LLM`: `apply_model` (on one model) and `reset_prefix_cache`."""

    def __init__(self, model):
        self.model, self.resets = model, 0

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.resets += 1
        return True


class Engine:
    """What the wraps need of a `VLLMEngine`: `sync_weights` (which resets the prefix cache) and `llm`."""

    def __init__(self, model=None):
        self.calls: list[tuple[str, int]] = []
        self.llm = LLM(model)

    @property
    def resets(self):
        return self.llm.resets

    def sync_weights(self, named_tensors, version):
        self.calls.append(("engine", version))
        self.llm.reset_prefix_cache()


def tagging(engine, tag):
    def around(sync, tensors, version):
        engine.calls.append((f"{tag} in", version))
        sync(tensors, version)
        engine.calls.append((f"{tag} out", version))

    return around


class TestWrapSync:
    def test_newest_wrap_is_outermost(self):
        """Two wraps: the second installed runs first and last; the engine's own sync in the middle."""
        e = Engine()
        wrap_sync(e, tagging(e, "a"))
        wrap_sync(e, tagging(e, "b"))
        e.sync_weights([], 1)
        assert [c for c, _ in e.calls] == ["b in", "a in", "engine", "a out", "b out"]

    def test_removing_one_keeps_the_other(self):
        """Removing the first of two wraps leaves the second on; removing both gives the class's method back."""
        e = Engine()
        first, second = wrap_sync(e, tagging(e, "a")), wrap_sync(e, tagging(e, "b"))
        first.remove()
        first.remove()  # idempotent
        e.sync_weights([], 1)
        assert [c for c, _ in e.calls] == ["b in", "engine", "b out"]
        second.remove()
        assert "sync_weights" not in e.__dict__ and not second.active
        e.calls.clear()
        e.sync_weights([], 2)
        assert e.calls == [("engine", 2)]

    def test_a_foreign_instance_wrap_is_kept_inside(self):
        """A sync_weights set on the instance some other way stays the innermost, and comes back after."""
        e = Engine()
        own = lambda tensors, version: e.calls.append(("own", version))  # noqa: E731
        e.sync_weights = own
        wrap = wrap_sync(e, tagging(e, "a"))
        assert isinstance(e.sync_weights, SyncChain)
        e.sync_weights([], 1)
        assert [c for c, _ in e.calls] == ["a in", "own", "a out"]
        wrap.remove()
        assert e.sync_weights is own


class TestStackedFaults:
    @pytest.fixture
    def engine(self, tiny_model):
        from transformers import AutoModelForCausalLM

        return Engine(AutoModelForCausalLM.from_pretrained(tiny_model("llama")))

    def test_removing_the_prefix_fault_keeps_perturb_layer(self, engine):
        """stale-prefix-cache then perturb-layer on one engine: removing the first leaves perturb-layer
        re-applied after each sync and the cache reset again (the old removal deleted both wraps)."""
        from rlcheck.engines.vllm_perturb import PERTURB_FACTOR, PerturbHandle
        from rlcheck.engines.vllm_prefix import keep_prefix_cache

        kept = keep_prefix_cache(engine, start=1)
        perturb = PerturbHandle(engine, 1, PERTURB_FACTOR)
        engine.sync_weights([], 1)
        assert (kept.kept, perturb.syncs, engine.resets) == (1, 1, 0)
        kept.remove()
        engine.sync_weights([], 2)
        assert (kept.kept, perturb.syncs, engine.resets) == (1, 2, 1)
        perturb.remove()
        assert "sync_weights" not in engine.__dict__
