"""The sync check under TRL: what it costs per step, against TRL's own step, with the default budget
and with every sync checked.

    .venv/bin/python benchmarks/bench_trl_sync_check.py [--steps 30] [--out /tmp/rlcheck-trl-sync-check]

Each run is a real `RLCheckGRPOTrainer` (trl 1.16, vLLM colocated on CPU in bf16 as TRL builds it, the
tiny Llama, 8 completions of up to 8 tokens a step, the TRL tests' settings) for `--steps` steps. A
callback times every optimizer step (TRL's generation, the sync and the update: the wall time the
check is a share of); the Monitor's metrics.jsonl gives each checked sync's `sync/check_seconds` (the
engine's fingerprint plus the streamed weights' fingerprinting). Prints, per budget: syncs checked,
the mean and largest check, and the checks' total over the steps' total (the share of the run).
Writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BUDGETS = {"default (0.02)": 0.02, "every sync (None)": None}


def run(model: str, out: Path, steps: int, budget: float | None) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from rlcheck.core.monitor import MonitorConfig
    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.t0)

    clock = StepClock()
    args = GRPOConfig(output_dir=str(out), max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                      report_to=[], disable_tqdm=True, use_cpu=True, bf16=True, seed=0, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=128, vllm_gpu_memory_utilization=0.05)
    trainer = RLCheckGRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions], args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(8) for b in range(8)]}),
        monitor=MonitorConfig(run_dir=out / "rlcheck", sinks=("jsonl",)),
        rlcheck_options=TRLOptions(sync_check_budget=budget), callbacks=[clock])
    trainer.train()
    lines = [json.loads(line) for line in (out / "rlcheck" / "metrics.jsonl").read_text().splitlines()]
    checks = [line["metrics"]["sync/check_seconds"] for line in lines if "sync/check_seconds" in line["metrics"]]
    steps_s = clock.seconds[1:]  # the first step holds vLLM's warm-up
    return {"steps": len(clock.seconds), "checked": len(checks), "check_mean_s": statistics.mean(checks),
            "check_max_s": max(checks), "step_median_s": statistics.median(steps_s),
            "share": sum(checks[1:]) / sum(steps_s), "alarms": sum(len(line["alarms"]) for line in lines)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("/tmp/rlcheck-trl-sync-check"))
    a = p.parse_args()
    from rlcheck.modelzoo import build_model

    a.out.mkdir(parents=True, exist_ok=True)
    model = a.out / "model"
    if not model.exists():
        build_model("llama", model)
    summary = {name: run(str(model), a.out / name.split()[0], a.steps, budget) for name, budget in BUDGETS.items()}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("| budget | steps | syncs checked | check mean s | check max s | step median s | checks / run time | alarms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in summary.items():
        print(f"| {name} | {r['steps']} | {r['checked']} | {r['check_mean_s']:.4f} | {r['check_max_s']:.4f} | "
              f"{r['step_median_s']:.2f} | {100 * r['share']:.2f}% | {r['alarms']} |")


if __name__ == "__main__":
    main()
