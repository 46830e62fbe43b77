"""The trainer's weight gather for a sync: FSDP2's `full_state_dict` (cast on the device, gathered
tensor by tensor, one host copy: `rlcheck.trainers.staging`) against torch's `get_model_state_dict`
with `cpu_offload`, then a cast on the host (what it did before), at world size 1.

    .venv/bin/python benchmarks/bench_weight_gather.py [--layers 8] [--hidden 512]

A tied Qwen2 (vocab 32000), bf16 (float32 masters) and float32; the second of two calls is timed.
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist


def main() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcheck.trainers.backends import FSDP2Backend
    from rlcheck.trainers.config import TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = Qwen2Config(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=3 * args.hidden, vocab_size=32000, tie_word_embeddings=True)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    try:
        for dtype in ("bfloat16", "float32"):
            model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
            backend = FSDP2Backend(TrainerConfig(model="-", backend="fsdp2", dtype=dtype), model)
            for _ in range(2):
                t0 = time.perf_counter()
                {n: t.to(getattr(torch, dtype)) for n, t in get_model_state_dict(backend.module, options=options).items()}
                t1 = time.perf_counter()
                backend.full_state_dict()
                t2 = time.perf_counter()
            params = sum(p.numel() for p in model.parameters()) / 1e6
            print(f"| {dtype} | {params:.1f}M | before {t1 - t0:.3f} s | now {t2 - t1:.3f} s |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
