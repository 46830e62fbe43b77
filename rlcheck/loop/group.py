"""The Ray actors of a run: `TrainerGroup` (N ranks with torch.distributed inside) and the rollout
actor. Every call goes to all ranks at once (their forwards are collectives) and is joined."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.engines.vllm import VLLMConfig
from rlcheck.loop.placement import Placement
from rlcheck.trainers import MicroBatchPlan, Sequences, TrainerConfig, plan_micro_batches


class TrainerGroup:
    """`world_size` `TrainerWorker` actors in one placement group, rendezvoused on rank 0's node."""

    def __init__(self, cfg: TrainerConfig, world_size: int, placement: Placement | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlcheck.loop.actors import TrainerWorker

        if cfg.backend == "hf" and world_size != 1:
            raise ValueError("the hf backend runs on one process: world_size must be 1 (use fsdp2 or deepspeed)")
        p = placement or Placement()
        self.cfg, self.world_size = cfg, world_size
        bundle = {"CPU": p.trainer_cpus} | ({"GPU": p.trainer_gpus} if p.trainer_gpus else {})
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=p.strategy)
        ray.get(self.pg.ready())
        cls = ray.remote(TrainerWorker)
        self.workers = [
            cls.options(
                num_cpus=p.trainer_cpus, num_gpus=p.trainer_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": p.actor_env(cfg.device)},
            ).remote(cfg, r, world_size)
            for r in range(world_size)
        ]
        addr, port = ray.get(self.workers[0].address.remote())
        self.describe = ray.get([w.setup.remote(addr, port) for w in self.workers])

    def plan(self, seqs: Sequences) -> MicroBatchPlan:
        return plan_micro_batches(seqs, self.world_size, self.cfg.micro_batch_tokens)

    def logprobs(self, seqs: Sequences, plan: MicroBatchPlan) -> list[np.ndarray]:
        """Each sequence's response-token logprobs under the current weights, in sequence order."""
        import ray

        ref = ray.put(seqs)
        merged: dict[int, np.ndarray] = {}
        for part in ray.get([w.logprobs.remote(ref, plan) for w in self.workers]):
            merged.update(part)
        return [merged[i] for i in range(len(seqs))]

    def train_step(self, seqs: Sequences, plan: MicroBatchPlan) -> dict[str, float]:
        """One update on all ranks; the ranks' sums are added, the grad norm is global already."""
        import ray

        ref = ray.put(seqs)
        parts = ray.get([w.train_step.remote(ref, plan) for w in self.workers])
        tokens = max(seqs.num_response_tokens, 1)
        return {
            "loss": sum(p["loss_sum"] for p in parts) / tokens,
            "clip_frac": sum(p["clipped_tokens"] for p in parts) / tokens,
            "ratio_max": max(p["ratio_max"] for p in parts),
            "grad_norm": parts[0]["grad_norm"],
        }

    def full_state_dict_ref(self) -> Any:
        """An object ref to rank 0's gathered weights (every rank takes part in the gather)."""
        import ray

        refs = [w.full_state_dict.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs))
        return refs[0]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # noqa: BLE001 - a dead rank: kill the rest regardless
            pass
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)


def start_rollout(cfg: VLLMConfig, placement: Placement | None = None, engine_fault=None):
    """The rollout actor (a `RolloutWorker` with its vLLM engine loaded, and `engine_fault` injected)."""
    import ray

    from rlcheck.loop.actors import RolloutWorker

    p = placement or Placement()
    actor = ray.remote(RolloutWorker).options(
        num_cpus=p.rollout_cpus, num_gpus=p.rollout_gpus,
        runtime_env={"env_vars": p.actor_env("cuda" if p.rollout_gpus else "cpu")},
    ).remote(cfg, engine_fault)
    ray.get(actor.weight_version.remote())  # raise here if the engine failed to load
    return actor
