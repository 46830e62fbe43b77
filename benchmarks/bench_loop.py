"""Where the time of a GRPO step goes, and the monitor's share of it, in the real loop on this machine.

    .venv/bin/python benchmarks/bench_loop.py [--trainer fsdp2|deepspeed|hf] [--world-size 2] [--steps 30] [--warmup 3]

Runs `rlcheck.loop.run_grpo` with the configuration of `recipes/grpo_tiny.py` (tiny hybrid model,
vLLM CPU rollout actor, `--world-size` trainer ranks on a local Ray, the Monitor with the JSONL sink;
8 prompts x 8 samples x at most 32 tokens per step) for `--steps` steps, drops the first `--warmup`
(engine and allocator warm-up, the first step's lazy inits), and prints a markdown table from
`LoopResult.timings`: per phase the median and mean seconds and the phase's share of the mean step.
`other` is the step's time outside the five phases (prompt encoding, rewards, `loop.jsonl`, anything
else the driver does between them). The monitor phase is the driver's: `Monitor.observe` with its
sinks and its fsynced state file (plus building the `StepBatch` where the driver times that inside
it); the target for its share of the step is <= 2%. Also printed: the run's alarms and largest |d|,
to show the timed run was a healthy one.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGET_MONITOR_SHARE = 0.02
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", default="fsdp2", choices=("fsdp2", "deepspeed", "hf"))
    ap.add_argument("--world-size", type=int, default=None, help="trainer ranks (default: 2; 1 for hf)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the figures")
    ap.add_argument("--model", default=None, help="model directory (default: a tiny hybrid built in a temp dir)")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error("need 0 <= --warmup < --steps")

    sys.path.insert(0, str(RECIPES))
    import grpo_tiny

    from rlcheck.core import metrics as K
    from rlcheck.core.monitor import Monitor
    from rlcheck.loop import ray_session, run_grpo

    print(f"command: `{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}`\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--trainer", args.trainer, "--steps", str(args.steps), "--run-dir", os.path.join(tmp, "run"),
                "--model", args.model or os.path.join(tmp, "tiny-hybrid")]
        if args.world_size is not None:
            argv += ["--world-size", str(args.world_size)]
        rargs = grpo_tiny.parse_args(argv)
        cfg = grpo_tiny.loop_config(rargs, grpo_tiny.ensure_model(rargs.model))
        t0 = time.perf_counter()
        with ray_session(num_cpus=4), Monitor(grpo_tiny.monitor_config(rargs.run_dir, cfg, "bench_loop")) as mon:
            result = run_grpo(cfg, mon)
        wall = time.perf_counter() - t0
    if result.halted:
        raise SystemExit(f"the monitor halted the run at step {result.steps_run - 1}: {result.reason}")
    steps = result.timings[args.warmup:]
    alarms = sum(len(r.alarms) for r in result.reports)
    max_abs_diff = max(r.metrics[K.ABS_DIFF_MAX] for r in result.reports)
    monitor_own = [r.metrics[K.MONITOR_SECONDS] for r in result.reports[args.warmup:]]
    print(f"{args.trainer}, world size {cfg.world_size}: {len(steps)} steps measured (of {result.steps_run}, "
          f"first {args.warmup} left out); whole run {wall:.0f} s including start-up; {alarms} alarms, "
          f"max |d| {max_abs_diff:.2g}; {machine()}\n")
    print_table(steps)
    print_monitor_share(steps, monitor_own)


def print_table(steps: list[dict[str, float]]) -> None:
    from rlcheck.loop import PHASES

    for t in steps:
        t["other"] = t["total"] - sum(t[p] for p in PHASES)
    mean_total = statistics.fmean(t["total"] for t in steps)
    print("| phase | median s | mean s | share of step |")
    print("|---|---|---|---|")
    for phase in (*PHASES, "other", "total"):
        values = [t[phase] for t in steps]
        mean = statistics.fmean(values)
        print(f"| {phase} | {statistics.median(values):.3f} | {mean:.3f} | {mean / mean_total:.1%} |")


def print_monitor_share(steps: list[dict[str, float]], monitor_own: list[float]) -> None:
    shares = [t["monitor"] / t["total"] for t in steps]
    share = statistics.fmean(t["monitor"] for t in steps) / statistics.fmean(t["total"] for t in steps)
    verdict = "met" if share <= TARGET_MONITOR_SHARE else "missed"
    print(f"\nmonitor share of the step: {share:.2%} of the mean step (per step: median {statistics.median(shares):.2%}, "
          f"max {max(shares):.2%}); target <= {TARGET_MONITOR_SHARE:.0%}: {verdict}. Of the monitor phase, "
          f"statistics and detectors (rlcheck/monitor/seconds) take median {statistics.median(monitor_own) * 1e3:.1f} ms")


def machine() -> str:
    import ray
    import torch
    import vllm

    return (f"{os.cpu_count()} CPU cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"vllm {vllm.__version__}, ray {ray.__version__}")


if __name__ == "__main__":
    main()
