"""The trainer ranks of a run as Ray actors: `TrainerGroup` (N ranks with torch.distributed inside).
Every call goes to all ranks at once (their forwards are collectives) and is joined with
`rlcheck.loop.recovery.join`: a dead rank is noticed at once, not when the others time out."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.errors import ActorDiedError, ConfigError
from rlcheck.loop.placement import Placement
from rlcheck.loop.recovery import ActorLost, join, kill_actors, start_rollout
from rlcheck.loop.resources import wait_placed
from rlcheck.trainers import MicroBatchPlan, Sequences, TrainerConfig, plan_micro_batches

__all__ = ["TrainerGroup", "start_rollout"]

DEFAULT_CALL_TIMEOUT_S = 600.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0


class TrainerGroup:
    """`world_size` `TrainerWorker` actors in one placement group, rendezvoused on rank 0's node.
    `call_timeout_s` bounds every call (`ActorLost` past it); `collective_timeout_s` is the process
    group's timeout, so a rank left alone in a collective raises instead of waiting forever."""

    def __init__(self, cfg: TrainerConfig, world_size: int, placement: Placement | None = None, *,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlcheck.loop.actors import TrainerWorker

        if cfg.backend == "hf" and world_size != 1:
            raise ConfigError("the hf backend runs on one process: world_size must be 1 (use fsdp2 or deepspeed)")
        p = placement or Placement()
        self.cfg, self.world_size, self.timeout_s = cfg, world_size, call_timeout_s
        self.names = [f"trainer rank {r}/{world_size}" for r in range(world_size)]
        self.pg = placement_group([p.trainer_bundle() for _ in range(world_size)], strategy=p.strategy)
        wait_placed(self.pg, p, world_size)  # a clear error, not a wait forever, when it cannot be placed
        cls = ray.remote(TrainerWorker)
        self.workers = [
            cls.options(
                num_cpus=p.trainer_cpus, num_gpus=p.trainer_gpus, resources=dict(p.trainer_resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": p.actor_env(cfg.device)},
            ).remote(cfg, r, world_size)
            for r in range(world_size)
        ]
        try:  # each rank loads its model and joins the group within call_timeout_s, or the run stops here
            [(addr, port)] = join([self.workers[0].address.remote()], self.names[:1], call_timeout_s)
            self.describe = self._all(lambda w: w.setup.remote(addr, port, collective_timeout_s))
        except ActorLost as lost:
            self.shutdown(graceful=False)
            raise ActorDiedError(lost.actor, 0, "start", f"{lost.detail}; the trainer ranks did not start "
                                 "(LoopConfig.call_timeout_s bounds their load)") from lost
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _all(self, call) -> list:
        """`call(worker)` on every rank, joined (`ActorLost` naming the first rank lost)."""
        return join([call(w) for w in self.workers], self.names, self.timeout_s)

    def plan(self, seqs: Sequences) -> MicroBatchPlan:
        return plan_micro_batches(seqs, self.world_size, self.cfg.micro_batch_tokens)

    def logprobs(self, seqs: Sequences, plan: MicroBatchPlan, temperature: float | None = None,
                 at: str | None = None) -> list[np.ndarray]:
        """Each sequence's response-token logprobs under the current weights, in sequence order (at
        the trainer's temperature unless `temperature` is given; at the dtype `at` if given)."""
        import ray

        ref = ray.put(seqs)
        merged: dict[int, np.ndarray] = {}
        for part in self._all(lambda w: w.logprobs.remote(ref, plan, temperature, at)):
            merged.update(part)
        return [merged[i] for i in range(len(seqs))]

    def topk_logprobs(self, seqs: Sequences, plan: MicroBatchPlan, top_k: int, routing: bool = False) -> list[tuple]:
        """As `logprobs`, and from the same pass each sequence's logprobs at `seqs.topk_ids` and its
        own top-`top_k` ids: one (logp (L,), logp_at (L, K) | None, ids (L, top_k) | None) per
        sequence, in sequence order, and with `routing` its experts (L, layers, k) as well
        (`PolicyTrainer.topk_logprobs`)."""
        import ray

        ref = ray.put(seqs)
        merged: dict[int, tuple] = {}
        for part in self._all(lambda w: w.topk_logprobs.remote(ref, plan, top_k, routing)):
            merged.update(part)
        return [merged[i] for i in range(len(seqs))]

    def train_step(self, seqs: Sequences, plan: MicroBatchPlan) -> dict[str, float]:
        """One update on all ranks; the ranks' sums are added, the grad norm is global already."""
        import ray

        ref = ray.put(seqs)
        parts = self._all(lambda w: w.train_step.remote(ref, plan))
        tokens = max(seqs.num_loss_tokens, 1)
        return {
            "loss": sum(p["loss_sum"] for p in parts) / tokens,
            "clip_frac": sum(p["clipped_tokens"] for p in parts) / tokens,
            "ratio_max": max(p["ratio_max"] for p in parts),
            "grad_norm": parts[0]["grad_norm"],
        }

    def fingerprint(self, engine_dtype: str, meanwhile: Any = None) -> tuple[Any, Any]:
        """The sync check's fingerprint of the trainer's weights (every rank's part, added up), and
        what `meanwhile()` returns, called while the ranks compute (the engine's side, in parallel)."""
        from rlcheck.core.sync_check import merge_fingerprints

        refs = [w.fingerprint.remote(engine_dtype) for w in self.workers]
        other = meanwhile() if meanwhile is not None else None
        return merge_fingerprints(join(refs, self.names, self.timeout_s)), other

    def gather_weights(self) -> None:
        """Every rank takes part in gathering the full weights; rank 0 keeps them (for `take_weights`
        or a collective send, `rlcheck.loop.weight_sync`). The driver joins on small answers."""
        self._all(lambda w: w.gather_weights.remote())

    def full_state_dict_ref(self) -> Any:
        """An object ref to rank 0's gathered weights (the weights go from rank 0 to whoever gets the ref)."""
        self.gather_weights()
        return self.workers[0].take_weights.remote()

    def shutdown(self, graceful: bool = True) -> None:
        """Destroy the process groups (`graceful`: ask each rank first, for at most 60 s) and kill the
        ranks. After a lost rank pass graceful=False: the others may sit in a collective and would
        answer only when it times out; killing them ends their process groups with them."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception:  # noqa: BLE001 - a dead rank: kill the rest regardless
                pass
        kill_actors(self.workers)
        remove_placement_group(self.pg)
