"""Lost actors in the real loop (vLLM rollout actor, trainer ranks on Ray): a killed rollout engine is
replaced and the run goes on with the trainer's weights in the fresh engine; past the bound, or when a
trainer rank dies, the run stops cleanly within seconds with every actor dead and the Monitor's files
whole. The kills are real (`ray.kill` from a timer thread while a step runs).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import replace

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import ActorDiedError, ConfigError, MismatchHalt
from rlcheck.forensics.diagnose import RESTART_AGE, diagnose
from rlcheck.loop import GRPOLoop, LoopResult
from rlcheck.loop.presets import tiny_cpu
from rlcheck.loop.recovery import ENGINE_RESTARTS, STEPS_SINCE_RESTART
from rlcheck.loop.weight_sync import CollectiveSync, WeightSyncConfig
from rlcheck.sinks import Sink
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

HALT_BOUND_S = 60.0


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class Killer(Sink):
    """Runs `action()` (a kill) `delay` seconds after each step in `after`: after the loop finished it
    (as `run`'s on_step callback), or after the Monitor logged it (as a sink: during its update)."""

    def __init__(self, action, after: tuple[int, ...], delay: float):
        self.action, self.after, self.delay = action, after, delay
        self.killed_at: float | None = None

    def __call__(self, step, report, info) -> None:
        self.log(step, {})

    def log(self, step, record) -> None:
        if step in self.after:
            threading.Timer(self.delay, self._act).start()

    def _act(self) -> None:
        self.killed_at = time.monotonic()
        self.action()


def kill(ray, target):
    """An action: `ray.kill(target())`, the actor as it is when the timer fires."""
    return lambda: ray.kill(target())


def _run(loop: GRPOLoop, killer: Killer | None = None):
    try:
        result = loop.run(killer)
        stopped_at = time.monotonic()
    finally:
        loop.close()
    return result, stopped_at


def _assert_dead(ray, loop: GRPOLoop) -> None:
    for call in [loop.rollout.weight_version, *(w.address for w in loop.group.workers)]:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(call.remote(), timeout=30)


def _assert_files_whole(run_dir, steps: list[int]) -> None:
    """metrics.jsonl holds whole lines for exactly `steps`; state.json was saved after the last."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == steps
    assert json.loads((run_dir / "state.json").read_text())["last_step"] == steps[-1]


@pytest.mark.slow
@pytest.mark.timeout(400)
class TestEngineRestart:
    def test_killed_engine_is_replaced_with_the_trainers_weights(self, tiny_model, ray_local, tmp_path):
        """The rollout actor killed during step 1's generate: a fresh engine with weight version 1 takes
        over, the restart is logged at step 1, and the run finishes its 4 steps without an alarm. The
        syncs go through the collective (`WeightSyncConfig("collective")`, small buckets): the fresh
        engine gets its first weights through the object store, and step 1's sync opens a fresh group
        with it (the restart with object-store syncs: test_engine_lost_past_the_bound_halts_cleanly)."""
        cfg = replace(tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=4),
                      weight_sync=WeightSyncConfig("collective", bucket_mb=0.25))  # ~6 MB of fp32: many buckets
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            loop = GRPOLoop(cfg, mon)
            first, sync = loop.rollout, loop.send_weights
            assert isinstance(sync, CollectiveSync)
            try:
                result = loop.run(Killer(kill(ray_local, lambda: loop.rollout), after=(0,), delay=0.1))
                assert ray_local.get(loop.rollout.weight_version.remote()) == loop.version == 4
                assert sync.peer is loop.rollout  # the fresh engine's group
            finally:
                loop.close()
        assert sync.last["buckets"] > 1 and sync.last["bytes"] > 1e6
        assert not result.halted and result.steps_run == 4 and result.error is None
        (restart,) = result.restarts
        assert (restart.step, restart.phase, restart.weight_version) == (1, "generate", 1)
        assert "ray.kill" in restart.cause and restart.seconds < HALT_BOUND_S
        with pytest.raises(ray_local.exceptions.RayActorError):
            ray_local.get(first.weight_version.remote(), timeout=30)
        logged = {r["step"]: r["engine_restarts"] for r in _lines(tmp_path / "loop.jsonl")}
        assert [len(logged[s]) for s in range(4)] == [0, 1, 0, 0] and logged[1][0]["event"] == "engine_restart"
        records = _lines(tmp_path / "metrics.jsonl")
        assert [r["metrics"][ENGINE_RESTARTS] for r in records] == [0, 1, 1, 1]
        assert [r["metrics"].get(STEPS_SINCE_RESTART) for r in records] == [None, 0, 1, 2]
        assert all(r["metrics"]["loop/weights_behind"] == 0 for r in records)
        assert max(r["metrics"][K.ABS_DIFF_MEAN] for r in records) < 1e-4  # the fresh engine holds the trainer's weights
        assert [a for r in result.reports for a in r.alarms] == []

    def test_engine_lost_past_the_bound_halts_cleanly(self, tiny_model, ray_local, tmp_path):
        """With max_engine_restarts=1 the first kill is survived and the second stops the run: halted, an
        ActorDiedError naming the rollout actor and phase, every actor dead, the Monitor's files whole."""
        cfg = replace(tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=4), max_engine_restarts=1)
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            loop = GRPOLoop(cfg, mon)
            result, _ = _run(loop, Killer(kill(ray_local, lambda: loop.rollout), after=(0, 1), delay=0.1))
        assert result.halted and result.steps_run == 2 and [r.step for r in result.restarts] == [1]
        err = result.error
        assert isinstance(err, ActorDiedError) and (err.actor, err.step, err.phase) == ("rollout rollout0", 2, "generate")
        assert "replaced 1 time(s) already (LoopConfig.max_engine_restarts = 1)" in result.reason
        _assert_dead(ray_local, loop)
        _assert_files_whole(tmp_path, [0, 1])
        last = _lines(tmp_path / "loop.jsonl")[-1]
        assert last["event"] == "actor_died" and last["actor"] == "rollout rollout0" and last["halted"]

    def test_failed_restart_halts_cleanly(self, tiny_model, ray_local, tmp_path):
        """The engine killed and its model folder gone: the fresh engine cannot start, and the run stops
        cleanly with an ActorDiedError that says so."""
        model = shutil.copytree(tiny_model("hybrid"), tmp_path / "model")
        cfg = tiny_cpu(model, trainer="hf", steps=4)

        def kill_and_remove_model():
            ray_local.kill(loop.rollout)
            shutil.rmtree(model)

        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",))) as mon:
            loop = GRPOLoop(cfg, mon)
            result, _ = _run(loop, Killer(kill_and_remove_model, after=(0,), delay=0.1))
        assert result.halted and isinstance(result.error, ActorDiedError) and result.restarts == []
        assert "a fresh engine did not start" in result.reason
        _assert_dead(ray_local, loop)
        _assert_files_whole(tmp_path / "run", [0])


@pytest.mark.slow
@pytest.mark.timeout(400)
class TestTrainerLoss:
    def test_killed_rank_stops_the_run_within_the_bound(self, tiny_model, ray_local, tmp_path):
        """Rank 1 of two FSDP2 ranks killed during step 1's update: the driver notices, kills the rest
        (rank 0 sits in a collective) and returns a halt naming the rank and phase well within a minute."""
        cfg = tiny_cpu(tiny_model("hybrid"), trainer="fsdp2", world_size=2, steps=4)
        killer = Killer(kill(ray_local, lambda: loop.group.workers[1]), after=(1,), delay=0.2)
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl", killer))) as mon:
            loop = GRPOLoop(cfg, mon)
            result, stopped_at = _run(loop)
        assert killer.killed_at is not None and stopped_at - killer.killed_at < HALT_BOUND_S
        assert result.halted and isinstance(result.error, ActorDiedError) and result.steps_run == 1
        assert (result.error.actor, result.error.step, result.error.phase) == ("trainer rank 1/2", 1, "update")
        assert "not restarted" in result.reason
        _assert_dead(ray_local, loop)
        _assert_files_whole(tmp_path, [0, 1])
        assert _lines(tmp_path / "loop.jsonl")[-1]["actor"] == "trainer rank 1/2"


class TestDiagnoseAfterRestart:
    def test_alarm_right_after_a_restart_is_mentioned(self, tmp_path):
        """An alarm on the step a fresh engine started gets a line about the restart in the verdict's
        evidence, from the run directory and from the step's dump alone."""
        data = SyntheticConfig(num_sequences=32, mean_length=32)
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            for step in range(3):
                batch = synthetic_batch(data, step)
                if step == 2:  # a token-id mismatch: a signature alarm
                    batch = replace(batch, tokens_train=batch.tokens + 1)
                extra = {ENGINE_RESTARTS: 1.0, STEPS_SINCE_RESTART: 0.0} if step == 2 else {ENGINE_RESTARTS: 0.0}
                try:
                    mon.observe(step, batch, extra=extra)
                except MismatchHalt:  # the token-id mismatch halts at once, with a dump
                    pass
        for path in (tmp_path, tmp_path / "dumps" / "step_000002"):
            evidence = diagnose(path).verdict.evidence
            assert any("restarted" in line and "step(s) 2" in line for line in evidence), evidence

    def test_key_matches_the_loop(self):
        """diagnose spells the loop's restart-age metric the same way."""
        assert RESTART_AGE == STEPS_SINCE_RESTART


class TestLoopConfig:
    @pytest.mark.parametrize("field", ["max_engine_restarts", "call_timeout_s", "collective_timeout_s", "keep_reports"])
    def test_bad_fault_settings_are_refused(self, field):
        """A negative restart bound, a non-positive timeout or keep_reports < 1 is a ConfigError."""
        cfg = tiny_cpu("/nonexistent/model", trainer="hf")
        with pytest.raises(ConfigError):
            replace(cfg, **{field: -1})


class TestLoopResult:
    def test_keeps_the_last_reports_only(self):
        """Past `limit` steps the oldest report, timing and reward go; steps_run counts them all."""
        result = LoopResult()
        for step in range(5):
            result.keep(f"report {step}", {"seconds": {"total": step}, "reward_mean": step}, limit=3)
        assert result.steps_run == 5 and result.reports == ["report 2", "report 3", "report 4"]
        assert result.rewards == [2, 3, 4] and [t["total"] for t in result.timings] == [2, 3, 4]
