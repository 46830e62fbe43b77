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
    strategy: str = "PACK"
    """Placement-group strategy of the trainer ranks: PACK (fewest nodes), SPREAD, STRICT_PACK."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of every actor (e.g. NCCL settings)."""

    def __post_init__(self) -> None:
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"placement strategy {self.strategy!r} is not a Ray placement strategy")
        if min(self.trainer_cpus, self.trainer_gpus, self.rollout_cpus, self.rollout_gpus) < 0:
            raise ConfigError("actor resources must be >= 0")

    def actor_env(self, device: str) -> dict[str, str]:
        env = dict(QUIET_ACTOR_ENV)
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        env.update(self.env)
        return env


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
