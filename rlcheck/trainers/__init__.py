"""Trainers: the policy under training, on one process (plain HF) or sharded (FSDP2, DeepSpeed ZeRO 1-3).

Every backend does the same three things for the loop, through `PolicyTrainer`:

    trainer = PolicyTrainer(TrainerConfig(model="models/hybrid", backend="fsdp2"))  # inside a process group
    logps = trainer.logprobs(plan)             # list[np.ndarray]: each sequence's response-token logprobs
    stats = trainer.train_step(plan, batch)    # one clipped-surrogate (GRPO/PPO) update
    weights = trainer.full_state_dict()        # rank 0: [(name, cpu tensor)] for the rollout engine

`plan` says which sequences this rank scores in which micro-batch (`rlcheck.trainers.batching`), so
every rank runs the same number of forwards: FSDP2 and ZeRO-3 gather weights collectively.
"""

from rlcheck.trainers.batching import MicroBatchPlan, Sequences, plan_micro_batches
from rlcheck.trainers.config import BACKENDS, TrainerConfig
from rlcheck.trainers.loss import clipped_surrogate, group_advantages
from rlcheck.trainers.policy import PolicyTrainer

__all__ = [
    "BACKENDS",
    "MicroBatchPlan",
    "PolicyTrainer",
    "Sequences",
    "TrainerConfig",
    "clipped_surrogate",
    "group_advantages",
    "plan_micro_batches",
]
