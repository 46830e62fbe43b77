"""What `grpo_fsdp_gpu.py` and `grpo_deepspeed_gpu.py` share: their arguments, the loop config at
GPU scale, and the run. The monitor config, the step line and the summary are `grpo_tiny`'s
(imported from it: this folder is on sys.path when a recipe runs as a script). Not run on a GPU:
see either recipe's docstring."""

from __future__ import annotations

import argparse
import os
import sys
import time

from _cluster import add_cluster_args, placement, ray_address
from grpo_tiny import monitor_config, print_step, print_summary

from rlcheck.core.monitor import Monitor
from rlcheck.engines.vllm import VLLMConfig
from rlcheck.errors import ConfigError, RLCheckError
from rlcheck.faults import parse_inject
from rlcheck.loop import AdditionTask, LoopConfig, ray_session, run_grpo
from rlcheck.trainers import TrainerConfig


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments both GPU recipes take (a recipe adds its own)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], epilog="See the module docstring.")
    arg = ap.add_argument
    arg("--model", required=True, help="local HF model directory, the same path on every node "
        "(e.g. `hf download Qwen/Qwen2.5-0.5B --local-dir /shared/qwen2.5-0.5b`)")
    arg("--world-size", type=int, default=2, help="trainer ranks, one GPU each (default: %(default)s)")
    arg("--tp", type=int, default=1, help="vLLM tensor_parallel_size: GPUs of the rollout actor (default: %(default)s)")
    arg("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
        help="weights of vLLM and of the trainer (default: %(default)s)")
    arg("--steps", type=int, default=200, help="GRPO steps (default: %(default)s)")
    arg("--prompts", type=int, default=64, help="prompts per step (default: %(default)s)")
    arg("--group-size", type=int, default=8, help="G: samples per prompt (default: %(default)s)")
    arg("--max-tokens", type=int, default=128, help="response tokens at most (default: %(default)s)")
    arg("--max-model-len", type=int, default=1024, help="vLLM context length (default: %(default)s)")
    arg("--gpu-memory-utilization", type=float, default=0.85,
        help="share of each rollout GPU vLLM takes: weights, then KV/Mamba cache (default: %(default)s)")
    arg("--micro-batch-tokens", type=int, default=16384,
        help="prompt + response tokens per forward per rank (default: %(default)s)")
    arg("--lr", type=float, default=1e-6, help="AdamW learning rate (default: %(default)s)")
    arg("--enforce-eager", action="store_true", help="no CUDA graphs in vLLM: faster start, slower decode")
    arg("--run-dir", help="run directory (default: runs/<recipe>-<time>)")
    arg("--inject", help="a fault to inject, as NAME=VALUE, e.g. skip-sync-every=4")
    arg("--wandb", choices=("online", "offline"), help="also log to W&B, online or offline")
    arg("--wandb-project", default="rlcheck", help="W&B project (default: %(default)s)")
    add_cluster_args(ap, address="auto")  # the cluster `ray start` set up; see recipes/_cluster.py
    return ap


def loop_config(args: argparse.Namespace, backend: str, zero_stage: int = 3) -> LoopConfig:
    temperature, fault = 1.0, parse_inject(args.inject)
    model = os.path.abspath(args.model)  # the actors resolve it on their own nodes, in their own cwd
    rollout = VLLMConfig(
        model=model,
        dtype=args.dtype,
        seed=0,
        engine_id="r0",
        temperature=temperature,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,  # the KV/Mamba cache gets what weights leave
        enforce_eager=args.enforce_eager,
        hookable=fault.engine_fault() is not None,  # an engine fault: eager, the V1 model runner (said on stderr)
        tensor_parallel_size=args.tp,
        # tp > 1: vLLM's worker processes are children of the rollout actor, on the GPUs Ray gave it
        # (see the recipe's docstring for why "mp" and not "ray")
        engine_kwargs={"distributed_executor_backend": "mp"} if args.tp > 1 else {},
    )
    trainer = TrainerConfig(
        model=model,
        backend=backend,
        zero_stage=zero_stage,
        dtype=args.dtype,
        lr=args.lr,
        max_grad_norm=1.0,
        clip_low=0.2,
        clip_high=0.2,
        temperature=temperature,
        micro_batch_tokens=args.micro_batch_tokens,
        seed=0,
        device="cuda",
    )
    return LoopConfig(
        rollout=rollout,
        trainer=trainer,
        world_size=args.world_size,
        steps=args.steps,
        group_size=args.group_size,
        task=AdditionTask(max_operand=999, num_prompts=args.prompts, seed=0),
        placement=placement(args, trainer_cpus=1, trainer_gpus=1, rollout_cpus=1, rollout_gpus=args.tp),
        fault=fault,
    )


def run(args: argparse.Namespace, recipe: str, backend: str, zero_stage: int = 3) -> int:
    """Run the recipe; 0 when it ran to the end, 1 when the monitor halted it, 2 on a bad setting."""
    if args.run_dir is None:
        args.run_dir = os.path.join("runs", time.strftime(f"{recipe}-%Y%m%d-%H%M%S"))
    address = ray_address(args)
    try:
        if not os.path.isdir(args.model):
            raise ConfigError(f"--model {args.model!r} is not a local directory; download the model first")
        cfg = loop_config(args, backend, zero_stage)
        with ray_session(address=address), Monitor(monitor_config(args.run_dir, cfg, recipe, args.wandb, args.wandb_project)) as monitor:
            result = run_grpo(cfg, monitor, print_step)
    except RLCheckError as exc:
        print(f"{recipe}: error: {exc}", file=sys.stderr)
        return 2
    print_summary(result, args.run_dir)
    return 1 if result.halted else 0
