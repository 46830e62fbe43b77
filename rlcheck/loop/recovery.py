"""What the loop does when an actor dies or hangs.

Every call to an actor is joined by `join`, which fails as soon as one of the called actors is dead
(`ray.get` of a list would wait for the others, which may sit in a collective with the dead one
forever), raised in the called method (an exception inside the actor: a `RayTaskError`), or when
`LoopConfig.call_timeout_s` passes without an answer; the failure is `ActorLost`, naming the actor.
Starting an actor is such a call too (the first rollout engine, the trainer ranks: a stalled load is
an `ActorDiedError` after `call_timeout_s`, not a wait forever). The driver then decides:

- the rollout engine: `RolloutSupervisor.restart` kills what is left of it and starts a fresh
  `RolloutWorker` (same config, same engine fault), syncs the trainer's current weights into it and
  records an `EngineRestart`; the step goes on. A fresh engine has empty caches (prefix cache, Mamba
  state slots), so a mismatch right after a restart is evidence of its own; the restart count and
  age go to the Monitor as `loop/` scalars, the event to loop.jsonl. At most `max_restarts` times;
  past that, or when the restart itself fails, it is an `ActorDiedError`.
- a trainer rank: no restart (its optimizer state and its shard are gone): `ActorDiedError`, and
  the driver kills every actor at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rlcheck.engines.vllm import VLLMConfig
from rlcheck.errors import ActorDiedError
from rlcheck.loop.placement import Placement

ENGINE_RESTARTS = "loop/engine_restarts"
"""Extra metric: rollout engines replaced so far in this run (0 while the first one lives)."""
STEPS_SINCE_RESTART = "loop/steps_since_engine_restart"
"""Extra metric, only once an engine was replaced: steps since the last restart (0: this step's
rollouts came from an engine started during this step)."""


class ActorLost(Exception):
    """An actor call failed because the actor died, or did not answer in time (internal to the loop)."""

    def __init__(self, actor: str, detail: str):
        self.actor, self.detail = actor, detail
        super().__init__(f"{actor}: {detail}")


@dataclass(frozen=True)
class EngineRestart:
    """One replacement of the rollout engine."""

    step: int
    phase: str
    """The loop phase the old engine was lost in (generate or sync)."""
    actor: str
    cause: str
    seconds: float
    """From noticing the loss to the fresh engine holding the trainer's weights."""
    weight_version: int
    """The trainer's weight version synced into the fresh engine."""

    def to_dict(self) -> dict[str, Any]:
        return {"event": "engine_restart", **asdict(self)}


def join(refs: list, names: list[str], timeout_s: float) -> list:
    """The results of `refs` (calls to the actors `names`), in order; `ActorLost` as soon as one of
    them died, or when `timeout_s` passes with one still pending."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    name_of = dict(zip(refs, names, strict=True))
    values, pending, deadline = {}, list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            raise ActorLost(name_of[pending[0]], f"no answer within {timeout_s:g} s (LoopConfig.call_timeout_s)")
        try:
            values[ready[0]] = ray.get(ready[0])
        except RayActorError as exc:
            raise ActorLost(name_of[ready[0]], _summary(exc)) from exc
        except RayTaskError as exc:  # raised inside the method: the actor is lost to the run all the same
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            raise ActorLost(name_of[ready[0]], f"its call raised {_summary(cause)}") from exc
    return [values[ref] for ref in refs]


def kill_actors(actors: list, timeout_s: float = 30.0) -> None:
    """`ray.kill` each actor and return once every one of them is dead (a call to it fails), or after
    `timeout_s`: `ray.kill` only asks, and under load a call made just after it may still be served."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    for actor in actors:
        ray.kill(actor)
    alive, deadline = list(actors), time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        still = []
        for actor in alive:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=1.0)
                still.append(actor)
            except GetTimeoutError:
                still.append(actor)  # busy (a rank in a collective) until the kill lands
            except RayActorError:
                pass
        alive = still
        if alive:
            time.sleep(0.1)


def _summary(exc: BaseException, limit: int = 400) -> str:
    """The exception on one line (Ray's actor errors span several), cut at `limit` characters."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def start_rollout(cfg: VLLMConfig, placement: Placement | None, engine_fault, timeout_s: float):
    """The rollout actor (a `RolloutWorker` with its vLLM engine loaded, and `engine_fault` injected);
    `ActorLost` when it does not load within `timeout_s` (killed: it must not linger) or fails to."""
    import ray

    from rlcheck.loop.actors import RolloutWorker

    p = placement or Placement()
    actor = ray.remote(RolloutWorker).options(
        num_cpus=p.rollout_cpus, num_gpus=p.rollout_gpus, resources=dict(p.rollout_resources),
        runtime_env={"env_vars": p.actor_env("cuda" if p.rollout_gpus else "cpu")},
    ).remote(cfg, engine_fault)
    try:
        join([actor.weight_version.remote()], [f"rollout {cfg.engine_id}"], timeout_s)  # loaded, or lost
    except BaseException:
        ray.kill(actor)
        raise
    return actor


class RolloutSupervisor:
    """The rollout actor of a run, replaced by a fresh one (with the trainer's weights) when it dies."""

    def __init__(self, cfg: VLLMConfig, placement: Placement, engine_fault, max_restarts: int, timeout_s: float):
        self.cfg, self.placement, self.engine_fault = cfg, placement, engine_fault
        self.max_restarts, self.timeout_s = max_restarts, timeout_s
        self.name = f"rollout {cfg.engine_id}"
        try:
            self.actor = start_rollout(cfg, placement, engine_fault, timeout_s)
        except ActorLost as lost:
            raise ActorDiedError(self.name, 0, "start", f"{lost.detail}; the first rollout engine did not "
                                 "start (LoopConfig.call_timeout_s bounds its load)") from lost
        self.num_attempts = 0
        self.restarts: list[EngineRestart] = []

    def call(self, submit: Callable[[Any], Any]) -> Any:
        """The result of `submit(actor)` (an actor method's `.remote(...)`); `ActorLost` if the actor is lost."""
        return join([submit(self.actor)], [self.name], self.timeout_s)[0]

    def restart(self, lost: ActorLost, step: int, phase: str, weights: Callable[[], tuple[Any, int]]) -> EngineRestart:
        """Replace the lost engine and sync `weights()` = (object ref, version) into the new one.
        `ActorDiedError` past `max_restarts` or when the new engine does not start; `ActorLost` from
        `weights()` (a trainer rank) or from the new engine is the caller's to handle."""
        if self.num_attempts >= self.max_restarts:
            raise ActorDiedError(self.name, step, phase, f"{lost.detail}; it was replaced {self.num_attempts} "
                                 f"time(s) already (LoopConfig.max_engine_restarts = {self.max_restarts})")
        self.num_attempts += 1
        t0 = time.perf_counter()
        self.kill(graceful=False)
        try:
            self.actor = start_rollout(self.cfg, self.placement, self.engine_fault, timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to start is the end of the run
            raise ActorDiedError(self.name, step, phase, f"{lost.detail}; a fresh engine did not start "
                                 f"({_summary(exc)})") from exc
        ref, version = weights()
        self.call(lambda actor: actor.sync_weights.remote(ref, version))
        event = EngineRestart(step, phase, self.name, lost.detail, time.perf_counter() - t0, version)
        self.restarts.append(event)
        return event

    def metrics(self, step: int) -> dict[str, float]:
        """The restart scalars of `step` for the Monitor (`ENGINE_RESTARTS`, `STEPS_SINCE_RESTART`)."""
        out = {ENGINE_RESTARTS: float(len(self.restarts))}
        if self.restarts:
            out[STEPS_SINCE_RESTART] = float(step - self.restarts[-1].step)
        return out

    def kill(self, graceful: bool = True) -> None:
        """Kill the actor; `graceful`: close its engine first if it answers within 30 s (a lost or
        hung one would only make the caller wait)."""
        import ray

        if graceful:
            try:
                ray.get(self.actor.close.remote(), timeout=min(self.timeout_s, 30.0))
            except Exception:  # noqa: BLE001 - dead or hung: killing is enough
                pass
        kill_actors([self.actor])
