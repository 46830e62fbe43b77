"""A checkpoint engine for verl's fully async trainer on one host without a GPU: the trainer's weights
reach the rollouter's vLLM through a file. verl 0.9.1's engines for a trainer and a rollout on separate
resources (nccl, hccl, nixl, mooncake, kimi, delta_sharded) all move CUDA or NPU memory; this one is
registered as "cpu_file" (`actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_file`,
`...custom_backend_module=tests.verl_cpu.checkpoint_engine`).

The actor's rank 0 writes every (name, tensor) of a sync into DIR/v<global_steps>.pt (written beside and
renamed: a reader never sees half a file); each rollout worker waits for that file and yields its
tensors. DIR is RLCHECK_VERL_CKPT_DIR (default: a folder in the system's temp dir).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

POLL_SECONDS = 0.05


def _folder() -> Path:
    path = Path(os.environ.get("RLCHECK_VERL_CKPT_DIR") or Path(tempfile.gettempdir()) / "rlcheck-verl-ckpt")
    path.mkdir(parents=True, exist_ok=True)
    return path


@CheckpointEngineRegistry.register("cpu_file")
class FileCheckpointEngine(CheckpointEngine):
    """Weights through a file: rank 0 of the actor sends, every rollout worker receives."""

    def __init__(self, bucket_size: int = 0, **kwargs: Any):
        self.rank, self.is_sender = -1, False

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        actor = {"rank": list(range(actor_wg_world_size)), "is_sender": [True] * actor_wg_world_size}
        rollout = {"rank": list(range(rollout_world_size)), "is_sender": [False] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, is_sender: bool):
        self.rank, self.is_sender = rank, is_sender

    def finalize(self):
        pass

    async def send_weights(self, weights, global_steps: int | None = None):
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}  # every rank gathers
        if self.rank != 0:
            return {}
        path = _folder() / f"v{global_steps}.pt"
        partial = path.with_suffix(".part")
        torch.save(state, partial)
        os.replace(partial, path)
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        path = _folder() / f"v{global_steps}.pt"
        while not path.exists():
            await asyncio.sleep(POLL_SECONDS)
        for name, tensor in torch.load(path).items():
            yield name, tensor
