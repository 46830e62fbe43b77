"""One GRPO step at lr 1e-6 on the tiny Llama in bf16: the share of weights it moves and how well the
update agrees with a float32 trainer's, for the hf (plain) backend, FSDP2 now (float32 masters under a
bf16 MixedPrecisionPolicy) and, with --old, FSDP2 as it was (bf16 parameters, no mixed precision).

World size 1 over gloo, CPU; the batch and the update inputs are those of tests/integration/test_trainers.py.

Run:  .venv/bin/python benchmarks/bench_bf16_master.py [--old] [--steps 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlcheck.modelzoo import build_model  # noqa: E402
from rlcheck.trainers import PolicyTrainer, TrainerConfig, backends, plan_micro_batches  # noqa: E402
from tests.integration.test_trainers import in_order, sequences, update_inputs  # noqa: E402


def old_wrap(self, model):
    """FSDP2 before issue 19: bf16 parameters sharded as they are, AdamW over bf16 (no master weights)."""
    from torch.distributed.fsdp import fully_shard

    for layer in backends.decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def bf16_llama(folder: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = build_model("llama", folder / "fp32")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(folder / "bf16")
    AutoTokenizer.from_pretrained(src).save_pretrained(folder / "bf16")
    return str(folder / "bf16")


def update(cfg: TrainerConfig, batch, plan, steps: int) -> torch.Tensor:
    """(P,) every weight's change over `steps` train steps, in float32."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    t = PolicyTrainer(cfg)
    if cfg.backend == "fsdp2":
        def full():
            return get_model_state_dict(t.backend.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif getattr(t.backend, "masters", None) is not None:  # the hf backend's float32 masters
        def full():
            names = [n for n, p in t.backend.module.named_parameters() if p.requires_grad]
            return dict(zip(names, t.backend.masters, strict=True))
    else:
        def full():
            return dict(t.full_state_dict())
    before = {k: v.float().clone() for k, v in full().items()}
    for _ in range(steps):
        t.train_step(batch, plan)
    after = {k: v.float() for k, v in full().items()}
    return torch.cat([(after[n] - before[n]).flatten() for n in sorted(before)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", action="store_true", help="FSDP2 as it was before issue 19")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    if args.old:
        backends.FSDP2Backend._wrap = old_wrap
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainerConfig(model=bf16_llama(Path(tmp)), backend="fsdp2", dtype="bfloat16", lr=1e-6, micro_batch_tokens=40)
        seqs = sequences(0, 12)
        plan = plan_micro_batches(seqs, 1, 40)
        batch = update_inputs(seqs, in_order(PolicyTrainer(replace(cfg, backend="hf")).logprobs(seqs, plan)), seed=0)
        ref = update(replace(cfg, backend="hf", dtype="float32"), batch, plan, args.steps)
        rows = [("float32 (hf backend)", ref), ("bf16 hf (float32 masters)", update(replace(cfg, backend="hf"), batch, plan, args.steps)),
                ("bf16 fsdp2" + (" before issue 19" if args.old else ""), update(cfg, batch, plan, args.steps))]
    big = ref.abs() > 0.5e-6
    print("| trainer | weights moved | sign agrees with fp32 | |update - fp32| / |fp32| |\n|---|---|---|---|")
    for name, d in rows:
        moved = float((d != 0).float().mean())
        agree = float((torch.sign(d[big]) == torch.sign(ref[big])).float().mean())
        print(f"| {name} | {moved:.2%} | {agree:.2%} | {float((d - ref).norm() / ref.norm()):.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
