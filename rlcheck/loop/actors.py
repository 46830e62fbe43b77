"""The two kinds of Ray actor of the loop, as plain classes (`ray.remote` is applied where they are
started, so this module imports without Ray): a rollout worker around `VLLMEngine`, and one trainer
worker per rank around `PolicyTrainer`, with torch.distributed inside the group."""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

from rlcheck.engines.vllm import Rollout, VLLMConfig, VLLMEngine
from rlcheck.trainers import MicroBatchPlan, PolicyTrainer, Sequences, TrainerConfig


class RolloutWorker:
    """Generates rollouts with vLLM and takes weight syncs."""

    def __init__(self, cfg: VLLMConfig, engine_fault: tuple[str, dict[str, Any]] | None = None):
        from rlcheck.loop.resources import visible_devices

        visible = visible_devices(_gpu_ids(), os.environ)  # vLLM takes the first visible GPUs: make them Ray's
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.engine = VLLMEngine(cfg)
        self.fault = None
        self.fault_kind = None if engine_fault is None else engine_fault[0]
        if engine_fault is not None and engine_fault[0] == "stale-buffer":  # a self-test of the sync check
            from rlcheck.engines.vllm_sync import keep_conv_buffers_stale

            self.fault = keep_conv_buffers_stale(self.engine)
        elif engine_fault is not None and engine_fault[0] == "stale-prefix-cache":  # syncs keep the prefix cache
            from rlcheck.engines.vllm_prefix import keep_prefix_cache

            self.fault = keep_prefix_cache(self.engine, **engine_fault[1])
        elif engine_fault is not None:  # a self-test: an engine fault inside this engine only
            from rlcheck.engines.vllm_faults import inject

            kind, options = engine_fault
            self.fault = inject(self.engine, kind, **options)

    def generate(self, prompts: list[list[int]], step: int, n: int, seeds: list[int] | None = None) -> list[Rollout]:
        """n samples per prompt (`seeds`: one per prompt, a multi-turn task's later turns, else the step's),
        `fault_touched` set on those an engine fault injected here acted on: a state fault's (stale-state,
        index-wrap) the requests it rewrote, one on every forward (perturb-layer, moe-route-flip) every
        request; the loop knows the others' (stale-buffer: after a spoiled sync, stale-prefix-cache:
        `Fault.apply`)."""
        rollouts = self.engine.generate(prompts, step=step, n=n, seed=seeds)
        take = getattr(self.fault, "take_touched", None)
        hit = take() if take is not None else None
        every = take is None and self.fault_kind in ("perturb-layer", "moe-route-flip")
        return [dataclasses.replace(r, fault_touched=True) if every or (hit is not None and r.vllm_request_id in hit)
                else r for r in rollouts]

    def sync_weights(self, weights: list[tuple[str, Any]], version: int, spoil: str | None = None) -> int:
        """Load `weights` as `version`; `spoil`: a self-test (the `drop-sync`, `permute-sync` faults) that
        loads what `rlcheck.faults.base.spoil_sync` leaves of them, and still counts the sync as done."""
        from rlcheck.faults.base import spoil_sync

        self.engine.sync_weights(list(spoil_sync(weights, spoil)), version)
        return version

    def open_sync_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                        backend: str = "gloo") -> None:
        """The engine's workers join a weight-sync group with trainer rank 0 (`rlcheck.loop.weight_sync`),
        replacing any before: each as `rank` + its tensor-parallel rank (`rlcheck.engines.vllm_worker_sync`)."""
        from rlcheck.engines.vllm_worker_sync import join_workers

        if rank != 1:
            raise ValueError(f"the engine's workers take ranks 1.., not {rank}")
        join_workers(self.engine, host, port, world_size, timeout_s, backend)

    def receive_weights(self, version: int, spoil: str | None = None) -> dict[str, float]:
        """Take rank 0's broadcast weights as `version`, each worker bucket by bucket (`spoil`: as
        `sync_weights`); the bytes, the workers, the seconds waiting for buckets and loading them."""
        from rlcheck.engines.vllm_worker_sync import receive_into

        return receive_into(self.engine, version, spoil)

    def fingerprint(self) -> dict[str, tuple[float, float, float]]:
        """The engine's side of the sync check (`rlcheck.engines.fingerprint`)."""
        from rlcheck.engines.fingerprint import fingerprint_llm

        return fingerprint_llm(self.engine.llm)

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> list:
        """The engine's logprobs of fixed responses (teacher-forced, at temperature 1): the probe batch."""
        from rlcheck.engines.fingerprint import score_tokens

        return score_tokens(self.engine.llm, prompts, responses)

    def continue_greedy(self, prompts: list[list[int]], count: int) -> list[list[int]]:
        """Each prompt's greedy continuation of `count` tokens (the sync check's probe responses)."""
        from rlcheck.engines.fingerprint import greedy_tokens

        return greedy_tokens(self.engine.llm, prompts, count)

    def rescore(self, prompts: list[list[int]], responses: list[list[int]]) -> list:
        """The engine's logprobs of its own rollouts from a fresh prefill (the decode-prefill audit,
        `rlcheck.loop.audit`); a state fault injected for a self-test is suspended meanwhile."""
        from contextlib import nullcontext

        from rlcheck.engines.fingerprint import score_tokens

        with getattr(self.fault, "suspended", nullcontext)():
            return score_tokens(self.engine.llm, prompts, responses)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def effective_settings(self) -> dict[str, Any]:
        """How the engine runs, as vLLM resolved it (`rlcheck.engines.vllm_env.effective_settings`)."""
        from rlcheck.engines.vllm_env import effective_settings

        return effective_settings(self.engine.llm)

    def guard_violations(self) -> list[dict[str, Any]]:
        """The engine guard's violations since the last call (none when the guard is off)."""
        return self.engine.take_guard_violations()

    def guard_report(self) -> dict[str, Any] | None:
        """The engine guard's report since the last call (`VLLMEngine.take_guard_report`; None: no guard)."""
        return self.engine.take_guard_report()

    def write_guard(self, directory: str) -> str | None:
        return self.engine.write_guard(directory)

    def close(self) -> None:
        self.engine.close()


class TrainerWorker:
    """One rank of the trainer group: joins the process group, then runs `PolicyTrainer` calls."""

    def __init__(self, cfg: TrainerConfig, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.trainer: PolicyTrainer | None = None
        self._weights = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port for the group's rendezvous (asked of rank 0)."""
        ip = _node_ip()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, collective_timeout_s: float = 600.0) -> str:
        """Join the process group; a collective waiting longer than `collective_timeout_s` for a peer
        (a dead rank) raises instead of blocking forever."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from rlcheck.loop.resources import device_index

        # the GPU Ray assigned this rank: cuda:0 when Ray set CUDA_VISIBLE_DEVICES, its id when told not
        # to; LOCAL_RANK too, as DeepSpeed sets its device from that
        index = device_index(_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          LOCAL_RANK=str(index), WORLD_SIZE=str(self.world_size))
        if self.cfg.device.startswith("cuda"):
            torch.cuda.set_device(index)
        if self.cfg.backend != "hf":
            dist.init_process_group("nccl" if self.cfg.device.startswith("cuda") else "gloo",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=collective_timeout_s))
        self.trainer = PolicyTrainer(self.cfg, self.rank, self.world_size)
        return f"rank {self.rank}/{self.world_size} on {_node_ip()} ({self.cfg.backend})"

    def logprobs(self, seqs: Sequences, plan: MicroBatchPlan, temperature: float | None = None,
                 at: str | None = None):
        return self.trainer.logprobs(seqs, plan, temperature, at)

    def topk_logprobs(self, seqs: Sequences, plan: MicroBatchPlan, top_k: int, routing: bool = False):
        return self.trainer.topk_logprobs(seqs, plan, top_k, routing)

    def train_step(self, seqs: Sequences, plan: MicroBatchPlan) -> dict[str, float]:
        return self.trainer.train_step(seqs, plan)

    def full_state_dict(self):
        return self.trainer.full_state_dict()

    def fingerprint(self, engine_dtype: str) -> dict[str, list[float]]:
        return self.trainer.fingerprint(engine_dtype)

    def gather_weights(self) -> int:
        """Gather the full weights (every rank takes part); rank 0 keeps them for `take_weights`.
        Returns the number of tensors kept (0 on the other ranks): a small answer to join on."""
        self._weights = self.trainer.full_state_dict()
        return len(self._weights or ())

    def take_weights(self):
        """The weights of the last `gather_weights` (rank 0), handed over once."""
        weights, self._weights = self._weights, None
        return weights

    def open_sync_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                        backend: str = "gloo") -> None:
        """Rank 0: serve a weight-sync group with the engines (`rlcheck.loop.weight_sync`), replacing any before."""
        from rlcheck.engines.vllm_collective import SyncGroup

        self.sync_group = None  # the old store's port is freed before the new group is waited for
        self.sync_group = SyncGroup(host, port, rank, world_size, timeout_s, backend)

    def send_weights(self, bucket_bytes: int) -> dict[str, float]:
        """Rank 0: broadcast the last `gather_weights` to the engines in buckets, handed over once."""
        from rlcheck.engines.vllm_collective import send_weights

        weights, self._weights = self._weights, None
        return send_weights(self.sync_group, weights, bucket_bytes)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.trainer = None


def _gpu_ids() -> list:
    """The GPU ids Ray assigned this actor ([] outside Ray, or with no GPU)."""
    try:
        import ray

        return ray.get_gpu_ids() if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return []


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit tests): loopback
        return "127.0.0.1"
