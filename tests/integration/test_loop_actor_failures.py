"""Issue 42 item 12: the loop's calls to its Ray actors fail into its halt/restart handling, never past it:
an ordinary exception inside an actor method (a `RayTaskError`) is a lost actor (`ActorLost`, naming the
actor and the error), and a first rollout engine or trainer rank that never finishes loading stops the
run with an `ActorDiedError` after `call_timeout_s` (it waited forever before). Real Ray actors, stand-ins
for the engine and the ranks (no vLLM: what is tested is the calling, not the engine)."""

from __future__ import annotations

import sys
import time

import pytest

from rlcheck.errors import ActorDiedError


class RaisingActor:
    """An actor whose method raises an ordinary exception."""

    def call(self):
        raise ValueError("bad input inside the actor")


class StalledEngine:
    """Stands in for a `RolloutWorker` whose engine never finishes loading."""

    def __init__(self, cfg, engine_fault=None):
        pass

    def weight_version(self):
        time.sleep(3600)

    def close(self):
        pass


class StalledRank:
    """Stands in for a `TrainerWorker` whose model load (setup) never returns."""

    def __init__(self, cfg, rank, world_size):
        pass

    def address(self):
        return "127.0.0.1", 29500

    def setup(self, addr, port, timeout_s):
        time.sleep(3600)

    def shutdown(self):
        pass


@pytest.fixture
def stand_ins(ray_local):
    """Ray pickles this module's classes by value (the workers cannot import a test module)."""
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray_local
    ray_local.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestActorFailures:
    def test_exception_in_an_actor_method_is_a_lost_actor(self, stand_ins):
        """join turns a RayTaskError into ActorLost naming the actor and the original error (it escaped
        the driver's handling as a raw RayTaskError before)."""
        from rlcheck.loop.recovery import ActorLost, join

        actor = stand_ins.remote(RaisingActor).remote()
        with pytest.raises(ActorLost) as lost:
            join([actor.call.remote()], ["rollout e0"], 60.0)
        assert lost.value.actor == "rollout e0" and "ValueError: bad input inside the actor" in lost.value.detail
        stand_ins.kill(actor)

    def test_first_engine_that_never_loads_stops_the_run(self, stand_ins, monkeypatch):
        """A first rollout engine stalled in its load: ActorDiedError (phase "start") after call_timeout_s,
        naming the setting; the stalled actor is killed."""
        import rlcheck.loop.actors as actors
        from rlcheck.engines.vllm import VLLMConfig
        from rlcheck.loop.placement import Placement
        from rlcheck.loop.recovery import RolloutSupervisor

        monkeypatch.setattr(actors, "RolloutWorker", StalledEngine)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError, match="call_timeout_s") as died:
            RolloutSupervisor(VLLMConfig(model="unused"), Placement(), None, max_restarts=2, timeout_s=3.0)
        assert time.monotonic() - t0 < 60 and (died.value.actor, died.value.phase) == ("rollout e0", "start")

    def test_trainer_ranks_that_never_load_stop_the_run(self, stand_ins, monkeypatch):
        """A trainer rank stalled in its setup: ActorDiedError (phase "start") after call_timeout_s, the
        group shut down."""
        import rlcheck.loop.actors as actors
        from rlcheck.loop.group import TrainerGroup
        from rlcheck.trainers import TrainerConfig

        monkeypatch.setattr(actors, "TrainerWorker", StalledRank)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError, match="call_timeout_s") as died:
            TrainerGroup(TrainerConfig(model="unused"), 1, call_timeout_s=3.0)
        assert time.monotonic() - t0 < 60 and died.value.phase == "start"
        assert died.value.actor == "trainer rank 0/1"
