"""How the trainer's weights reach the rollout engine after each update: `WeightSyncConfig` picks one.

- "object-store" (the default): every rank takes part in gathering the full weights, rank 0 returns
  them into Ray's object store and the rollout actor pulls them (`RolloutWorker.sync_weights`). Simple,
  and fine for small models; each sync costs a copy into the store and one out of it.
- "collective": the same gather, then rank 0 broadcasts the weights to the engine over a group of
  their own (`backend`: gloo through host memory, or NCCL from GPU to GPU; "auto": NCCL when the
  trainer runs on CUDA) (rank 0 = trainer rank 0, 1.. = the engine's workers: the rollout actor's own
  process with one, each tensor-parallel worker with more) in flattened buckets of `bucket_mb`, which
  each worker loads bucket by bucket, its own shard (`rlcheck.engines.vllm_collective`,
  `rlcheck.engines.vllm_worker_sync`; NCCL with tensor_parallel_size > 1 is refused). The driver starts rank 0's send and the engine's receive together
  and joins both. The group is opened at the first sync, and again after an engine restart: the
  restart's own sync goes through the object store (`RolloutSupervisor.restart`), the next one opens a
  fresh group with the fresh engine. A peer that never joins or stops mid-sync raises
  `rlcheck.errors.WeightSyncError` after `LoopConfig.collective_timeout_s`.

Either way the version check, the sync check (fingerprints, probe) and the drop-sync fault
(`spoil`, the drop-sync and permute-sync self-tests: the engine loads what `rlcheck.faults.base.spoil_sync` leaves of them) behave the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.loop.recovery import join

METHODS = ("object-store", "collective")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class WeightSyncConfig:
    method: str = "object-store"
    """One of `METHODS` (see the module docstring)."""
    bucket_mb: float = 512.0
    """The collective's bucket size in MiB (vLLM's packed transfer uses 1 GiB): the engine holds one
    bucket at a time besides its weights; a decoder layer larger than this goes in a bucket of its own."""
    backend: str = "auto"
    """The collective's process group: "gloo" (host memory, TCP), "nccl" (GPU to GPU: trainer and
    engine on CUDA), or "auto" (nccl when the trainer's device is CUDA, else gloo)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"weight_sync method must be one of {METHODS}, got {self.method!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"weight_sync backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"weight_sync bucket_mb must be > 0, got {self.bucket_mb}")

    @property
    def bucket_bytes(self) -> int:
        return max(int(self.bucket_mb * 2**20), 1)

    def group_backend(self, trainer_device: str) -> str:
        """The collective's backend for a trainer on `trainer_device` ("cpu", "cuda", "cuda:1")."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if trainer_device.startswith("cuda") else "gloo"


class ObjectStoreSync:
    """Rank 0's gathered weights through Ray's object store into the engine."""

    def __init__(self, group: Any, engine: Any):
        self.group, self.engine = group, engine

    def __call__(self, version: int, spoil: str | None = None) -> None:
        ref = self.group.full_state_dict_ref()
        self.engine.call(lambda actor: actor.sync_weights.remote(ref, version, spoil))


class CollectiveSync:
    """Rank 0's gathered weights broadcast to the engine in buckets; the group is (re)opened whenever
    the engine is not the one it was opened with (the first sync, after a restart)."""

    def __init__(self, cfg: WeightSyncConfig, group: Any, engine: Any, collective_timeout_s: float, backend: str = "gloo"):
        self.cfg, self.group, self.engine, self.timeout_s = cfg, group, engine, collective_timeout_s
        self.backend = backend
        self.peer = None  # the rollout actor the group was opened with
        self.last: dict[str, float] = {}  # the last sync's engine-side stats (bytes, receive_s, load_s)

    def __call__(self, version: int, spoil: str | None = None) -> None:
        if self.peer is not self.engine.actor:
            self.open()
        self.group.gather_weights()
        trainer, actor = self.group.workers[0], self.engine.actor
        _, self.last = self._both(trainer.send_weights.remote(self.cfg.bucket_bytes),
                                  actor.receive_weights.remote(version, spoil))

    def open(self) -> None:
        """A fresh group of trainer rank 0 (its store's host) and the current engine."""
        trainer, actor = self.group.workers[0], self.engine.actor
        self.peer = None
        host, port = join([trainer.address.remote()], self.group.names[:1], self.engine.timeout_s)[0]
        world = 1 + self.engine.cfg.tensor_parallel_size  # rank 0 and each of the engine's workers
        self._both(trainer.open_sync_group.remote(host, port, 0, world, self.timeout_s, self.backend),
                   actor.open_sync_group.remote(host, port, 1, world, self.timeout_s, self.backend))
        self.peer = actor

    def _both(self, trainer_ref: Any, engine_ref: Any) -> list:
        """Rank 0's and the engine's halves, joined (`ActorLost` naming the first one lost)."""
        return join([trainer_ref, engine_ref], [self.group.names[0], self.engine.name], self.engine.timeout_s)


def make_sync(cfg: WeightSyncConfig, group: Any, engine: Any, collective_timeout_s: float, trainer_device: str = "cpu"):
    """The loop's sync (called as `sync(version, spoil)`) for `cfg.method`."""
    if cfg.method == "collective":
        return CollectiveSync(cfg, group, engine, collective_timeout_s, cfg.group_backend(trainer_device))
    return ObjectStoreSync(group, engine)
