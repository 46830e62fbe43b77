"""MoE routing in the real loop: the trained tiny MoE under the own GRPO loop (vLLM rollout actor, the hf
trainer, Ray), healthy and under `moe-route-flip=P`, on seeds not used to set the routing alarm.

    .venv/bin/python benchmarks/bench_moe_loop.py [--model runs/models/moe-trained] [--steps 8]
        [--flips 0 0.05 0.2 0.5] [--seeds 11 12] [--dtype float32|bfloat16] [--out /tmp/rlcheck-moe-loop]

Per run: the steps' route_agree_frac (min..max), the steps with the routing warning, any other alarm,
mean |d|, and diagnose's verdict. Prints the table of BENCHMARKS.md ("MoE routing agreement").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run_one(model: Path, flip: float, seed: int, steps: int, out: Path, dtype: str) -> dict:
    import dataclasses

    from rlcheck.core import metrics as K
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.faults import parse_inject
    from rlcheck.forensics.diagnose import diagnose
    from rlcheck.loop import run_grpo
    from rlcheck.loop.presets import tiny_cpu

    run_dir = out / f"{dtype}-flip{flip}-seed{seed}"
    fault = parse_inject(f"moe-route-flip={flip}" if flip else None, seed=seed)
    cfg = tiny_cpu(model, trainer="hf", world_size=1, steps=steps, fault=fault, seed=seed)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype=dtype))  # the trainer stays fp32
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
        run_grpo(cfg, mon)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    agree = [r["metrics"][K.MOE_ROUTE_AGREE_FRAC] for r in records]
    warned = sum(any(a["metric"] == K.MOE_ABS_DIFF_SHARE for a in r["alarms"]) for r in records)
    others = sorted({a["metric"] for r in records for a in r["alarms"] if a["metric"] != K.MOE_ABS_DIFF_SHARE})
    return {"engine": dtype, "flip": flip, "seed": seed, "steps": len(records), "agree_min": min(agree), "agree_max": max(agree),
            "warned": warned, "other_alarms": others, "verdict": diagnose(run_dir).verdict.cause,
            "abs_diff_mean": max(r["metrics"][K.ABS_DIFF_MEAN] for r in records)}


def main() -> None:
    from rlcheck.loop import ray_session
    from rlcheck.modelzoo import ensure_trained

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("runs/models/moe-trained"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--flips", type=float, nargs="*", default=[0.0, 0.05, 0.2, 0.5])
    ap.add_argument("--seeds", type=int, nargs="*", default=[11, 12])
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlcheck-moe-loop"))
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (the trainer's stays float32)")
    args = ap.parse_args()
    model = ensure_trained(args.model, "moe")
    rows = []
    with ray_session(num_cpus=4):
        for flip in args.flips:
            for seed in args.seeds:
                rows.append(run_one(model, flip, seed, args.steps, args.out, args.dtype))
                print(json.dumps(rows[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print("| engine | flip P | seed | steps | route_agree_frac | steps warned | other alarms | max mean \\|d\\| | diagnose |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['flip']:g} | {r['seed']} | {r['steps']} | {r['agree_min']:.3f}..{r['agree_max']:.3f} | {r['warned']} "
              f"| {', '.join(r['other_alarms']) or '-'} | {r['abs_diff_mean']:.2g} | {r['verdict']} |")


if __name__ == "__main__":
    main()
