"""A collective weight sync received by each of the engine's workers itself, tensor parallel included.

    join_workers(engine, host, port, world_size, timeout_s, "gloo")  # each worker joins as 1 + its TP rank
    receive_into(engine, version)                                     # each worker: buckets in, its shard loaded

Trainer rank 0 broadcasts the layout and the buckets (`rlcheck.engines.vllm_collective.send_weights`) to
a group of 1 + tensor_parallel_size processes: the engine's workers, not the rollout actor. Each worker
receives every bucket into a buffer of its own and loads it at once (`reload_weights` on its own model
runner), whose weight loaders keep the worker's shard of each tensor (a column-parallel layer's rows, a
row-parallel layer's columns, its heads of a fused QKV, ...). Nothing passes through the rollout
actor's process and nothing is sent on from it: before, each bucket landed whole in the actor and went
again, unsharded, to every worker through vLLM's `collective_rpc` (a second copy of the model per sync
for each worker). The broadcast still carries whole buckets: rank 0 does not cut them per worker.

With one worker in the actor's process (tensor_parallel_size 1, in-process engine) the worker is the
actor's own, as before. The group lives on each worker (`worker.rlcheck_sync_group`) from `join_workers`
until the next one; the workers take part in `collective_rpc` calls in lockstep, so each reloads bucket
i at the same time as the others, as a `collective_rpc("reload_weights")` per bucket did.
NCCL with tensor_parallel_size > 1 is refused (`check_backend`): every worker would join an NCCL group
with the trainer's rank 0 on a GPU of its own, which has not been run with rlcheck.
"""

from __future__ import annotations

import time
from typing import Any

from rlcheck.engines.vllm_collective import Buckets, SyncGroup, receive_buckets
from rlcheck.errors import ConfigError

GROUP_ATTR = "rlcheck_sync_group"


def check_backend(backend: str, tensor_parallel_size: int) -> None:
    """ConfigError for a weight-sync backend that cannot serve an engine of that many TP workers."""
    if backend == "nccl" and tensor_parallel_size > 1:
        raise ConfigError(
            f"weight_sync backend 'nccl' with tensor_parallel_size={tensor_parallel_size}: each tensor-parallel "
            "worker would join an NCCL group with trainer rank 0 on a GPU of its own, which rlcheck has not run; "
            "use WeightSyncConfig(backend='gloo') (each worker receives over host memory) or method='object-store'")


def join_workers(engine: Any, host: str, port: int, world_size: int, timeout_s: float, backend: str = "gloo") -> int:
    """Every worker of `engine` (a `VLLMEngine`) joins the weight-sync group at host:port as rank
    1 + its tensor-parallel rank, replacing any group it had; returns how many joined."""
    check_backend(backend, world_size - 1)
    return len(engine.llm.collective_rpc(_join, args=(host, port, world_size, timeout_s, backend)))


def _join(worker: Any, host: str, port: int, world_size: int, timeout_s: float, backend: str) -> int:
    setattr(worker, GROUP_ATTR, None)
    group = SyncGroup(host, port, 1 + _tp_rank(), world_size, timeout_s, backend)
    setattr(worker, GROUP_ATTR, group)
    return group.rank


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 without a TP group: one worker)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):
        return 0


class WorkerBuckets(Buckets):
    """The buckets of one collective sync as the workers receive them: what `VLLMEngine.sync_weights`
    takes (through any fault's wrap of it, as an object-store sync's weights); `load_buckets` calls
    `receive(llm)` instead of iterating. `spoil`: the drop-sync and permute-sync self-tests, applied
    by each worker to each bucket (`rlcheck.faults.base.spoil_sync`)."""

    def __init__(self, spoil: str | None = None):
        super().__init__(())
        self.spoil = spoil
        self.stats: list[dict[str, float]] = []

    def __iter__(self):
        raise TypeError("a workers' sync is received by the workers (WorkerBuckets.receive), not iterated")

    def receive(self, llm: Any) -> int:
        """Every worker receives and loads the buckets; the tensors loaded per worker (the same for all)."""
        self.stats = llm.collective_rpc(_receive, args=(self.spoil,))
        return int(min(s["tensors"] for s in self.stats))


def _receive(worker: Any, spoil: str | None) -> dict[str, float]:
    """In a worker: the layout and every bucket from its group, each loaded before the next comes."""
    from rlcheck.faults.base import spoil_sync

    group = getattr(worker, GROUP_ATTR, None)
    if group is None:
        raise RuntimeError("this vLLM worker joined no weight-sync group (join_workers first)")
    stats: dict[str, float] = {}
    tensors, load_s = 0, 0.0
    for bucket in receive_buckets(group, stats):
        bucket = list(spoil_sync(bucket, spoil)) if spoil else bucket
        t = time.perf_counter()
        if bucket:
            worker.reload_weights(weights_iterator=bucket)
        load_s += time.perf_counter() - t
        tensors += len(bucket)
    return {**stats, "tensors": float(tensors), "load_s": load_s, "rank": float(group.rank)}


def receive_into(engine: Any, version: int, spoil: str | None = None) -> dict[str, float]:
    """`engine` (a `VLLMEngine`) takes rank 0's weights as `version` through its `sync_weights` (so a
    fault's wrap acts on it), each worker receiving them itself; the bytes each worker received, the
    workers, and the seconds waiting for and loading buckets (the slowest worker's)."""
    buckets = WorkerBuckets(spoil)
    t0 = time.perf_counter()
    engine.sync_weights(buckets, version)
    per = buckets.stats
    return {"bytes": per[0]["bytes"], "buckets": per[0]["buckets"], "workers": float(len(per)),
            "receive_s": max(s["receive_s"] for s in per), "load_s": max(s["load_s"] for s in per),
            "seconds": time.perf_counter() - t0}
