"""Where the actors go: resources per actor, and a Ray session for the loop."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

from rlcheck.errors import ConfigError

QUIET_ACTOR_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine runs inside the rollout actor's process
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
}


@dataclass(frozen=True)
class Placement:
    """Resources of the actors. CPU defaults fit this laptop-sized case; GPU recipes give each
    trainer rank one GPU and the rollout actor `tensor_parallel_size` GPUs."""

    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0
    rollout_cpus: float = 1.0
    rollout_gpus: float = 0.0
    trainer_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources of each trainer rank (in its placement-group bundle), e.g. {"trainer": 1}
    with the trainer nodes started as `ray start --resources='{"trainer": 8}'`: it pins the ranks there."""
    rollout_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources of the rollout actor, e.g. {"rollout": 1}: it pins the engine to the nodes
    that have them."""
    strategy: str = "PACK"
    """Placement-group strategy of the trainer ranks: PACK (fewest nodes), SPREAD, STRICT_PACK."""
    schedule_timeout_s: float = 120.0
    """How long the trainer ranks' placement group may wait for its resources (held by other jobs, or
    there in total but not on one node) before the loop gives up with a `ClusterResourcesError`."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of every actor (e.g. NCCL settings)."""

    def __post_init__(self) -> None:
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"placement strategy {self.strategy!r} is not a Ray placement strategy")
        custom = [*self.trainer_resources.values(), *self.rollout_resources.values()]
        if min(self.trainer_cpus, self.trainer_gpus, self.rollout_cpus, self.rollout_gpus, *custom) < 0:
            raise ConfigError("actor resources must be >= 0")
        reserved = {"CPU", "GPU", "memory", "object_store_memory"} & {*self.trainer_resources, *self.rollout_resources}
        if reserved:
            raise ConfigError(f"custom resources {sorted(reserved)} are Ray's own: set them with "
                              "trainer_cpus/trainer_gpus/rollout_cpus/rollout_gpus")
        if self.schedule_timeout_s <= 0:
            raise ConfigError(f"schedule_timeout_s must be > 0, got {self.schedule_timeout_s}")

    def trainer_bundle(self) -> dict[str, float]:
        """One trainer rank's placement-group bundle: its CPUs, GPUs and custom resources."""
        return _nonzero({"CPU": self.trainer_cpus, "GPU": self.trainer_gpus, **self.trainer_resources})

    def rollout_request(self) -> dict[str, float]:
        """What the rollout actor asks of a node: its CPUs, GPUs and custom resources."""
        return _nonzero({"CPU": self.rollout_cpus, "GPU": self.rollout_gpus, **self.rollout_resources})

    def actor_env(self, device: str) -> dict[str, str]:
        env = dict(QUIET_ACTOR_ENV)
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        env.update(self.env)
        return env


def _nonzero(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if v}


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, log_to_driver: bool = False):
    """Connect to `address` (an existing cluster, "auto") or start a local Ray; a session that is
    already up is reused and left running. Shuts down only what it started."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver)
    else:
        ray.init(address=address, log_to_driver=log_to_driver)
    try:
        yield
    finally:
        ray.shutdown()
