"""TRL's measured floor (`rlcheck.integrations.trl.floor`): a float32 GRPOTrainer under TRL's vLLM ("auto": bf16 for a
float32 checkpoint), with the measure on or off, on one of the tiny models; per step the engine's clipped mean |d|, the
trainer's measure of its own bf16 noise on the same tokens, and the alarms.

    .venv/bin/python benchmarks/bench_trl_floor.py --model runs/models/moe-trained --steps 6 --out runs/trl-floor
    .venv/bin/python benchmarks/bench_trl_floor.py --model runs/models/moe-trained --steps 6 --off --out runs/trl-floor-off
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def length_reward(completions, **_):
    return [float(len(c)) for c in completions]


def run(model: str, steps: int, measure: bool, out: Path) -> list[tuple]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlcheck.core import metrics as K
    from rlcheck.core.monitor import MonitorConfig
    from rlcheck.errors import MismatchHalt
    from rlcheck.integrations.trl import TRLOptions, attach_monitor

    args = GRPOConfig(output_dir=str(out), max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                      report_to=[], disable_tqdm=True, use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=128, vllm_gpu_memory_utilization=0.05)
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(8) for b in range(8)]})
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data)
    attach_monitor(trainer, MonitorConfig(run_dir=out / "rlcheck", sinks=("jsonl",)), TRLOptions(measure_floor=measure))
    try:
        trainer.train()
    except MismatchHalt as halt:
        print("halted:", halt.reason)
    rows = []
    for line in (out / "rlcheck" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        m = r["metrics"]
        rows.append((r["step"], m[K.ABS_DIFF_CLIPPED_MEAN], m.get(K.FLOOR_MEASURED),
                     [f"{a['severity']} {a['metric']}" for a in r["alarms"]]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/models/moe-trained")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--off", action="store_true", help="TRLOptions(measure_floor=False)")
    ap.add_argument("--out", type=Path, default=Path("runs/trl-floor"))
    args = ap.parse_args()
    print("| step | engine clipped mean |d| | trainer's measure | engine / measure | alarms |\n|---|---|---|---|---|")
    for step, clipped, measured, alarms in run(args.model, args.steps, not args.off, args.out):
        ratio = f"{clipped / measured:.2f}" if measured else "-"
        print(f"| {step} | {clipped:.4f} | {measured if measured is None else f'{measured:.4f}'} | {ratio} | "
              f"{', '.join(alarms) or '-'} |")


if __name__ == "__main__":
    main()
