"""Beyond the sampled token (issue 18): the `rlcheck/dist/*` metrics of the real loop, clean and under a
temperature mismatch and a top-p fault, beside the sampled-token metrics; and what top-k costs the step.

    .venv/bin/python benchmarks/bench_topk.py [--steps 6] [--out /tmp/rlcheck-topk] [--json benchmarks/data/topk.json]
    .venv/bin/python benchmarks/bench_topk.py --table-only   # re-read benchmarks/data/topk.json

Every case runs `rlcheck.loop.run_grpo` with `tiny_cpu(model, trainer="hf", seed=0)` (vLLM rollout
actor, one HF trainer rank; 8 prompts x 8 samples of up to 32 tokens a step) in one local Ray session,
the engine returning its top-k (`VLLMConfig.top_logprobs` = K = 20, the trainer scoring the same ids
and its own top-K in its recompute pass: `rlcheck.loop.topk_wiring`), the Monitor with
`StatsConfig(distribution=True)` and halting off (a fault's run goes its full length). Per case, the
mean over the steps of the step metrics; bf16 cases set both sides' dtype to bfloat16.

Overhead: the clean fp32 case again with top-k off (same seed, same tokens: the rollouts do not depend
on K), and the mean seconds of each loop phase over steps 1.. (step 0 warms up) with it on and off.
A kernel row times `chunked_token_logprobs` alone (2048 rows, vocab 32,768, hidden 512, float32) with
and without `top_k=20, topk_ids=(2048, 20)` (interleaved, the minimum of 7 calls each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

SAMPLED = ("rlcheck/token/abs_diff_mean", "rlcheck/token/diff_mean", "rlcheck/token/kl_k3")
DIST = ("rlcheck/dist/kl_mean", "rlcheck/dist/kl_max", "rlcheck/dist/topk_overlap_mean",
        "rlcheck/dist/top1_agree_frac", "rlcheck/dist/tail_mass_rollout_mean", "rlcheck/dist/tail_mass_train_mean")
PHASES = ("generate", "recompute", "monitor", "update", "total")
CASES = (  # (model, dtype, fault spec, top_k)
    ("hybrid", "float32", None, 20), ("hybrid", "float32", "temperature-mismatch=1.1", 20),
    ("hybrid", "float32", "top-p=0.9", 20), ("hybrid", "float32", None, 0),
    ("hybrid-trained", "float32", None, 20), ("hybrid-trained", "float32", "temperature-mismatch=1.1", 20),
    ("hybrid-trained", "float32", "top-p=0.9", 20), ("hybrid-trained", "float32", None, 0),
    ("hybrid-trained", "bfloat16", None, 20), ("hybrid-trained", "bfloat16", "temperature-mismatch=1.1", 20),
    ("hybrid-trained", "bfloat16", "top-p=0.9", 20),
)


def run_case(model: str, dtype: str, spec: str | None, top_k: int, steps: int, out: Path) -> dict:
    from rlcheck.core.config import HaltConfig
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.core.stats import StatsConfig
    from rlcheck.faults import parse_inject
    from rlcheck.forensics.diagnose import diagnose
    from rlcheck.loop import run_grpo
    from rlcheck.loop.presets import tiny_cpu

    name = f"{model}-{dtype}-{spec or 'clean'}-k{top_k}".replace("=", "")
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = tiny_cpu(Path("runs/models") / model, trainer="hf", steps=steps, fault=parse_inject(spec), seed=0)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, top_logprobs=top_k, dtype=dtype),
                              trainer=dataclasses.replace(cfg.trainer, dtype=dtype))
    mcfg = MonitorConfig(run_dir=run_dir, sinks=("jsonl",), resume=False, halt=HaltConfig(enabled=False),
                         stats=StatsConfig(distribution=bool(top_k)), context=cfg.context())
    t0 = time.perf_counter()
    with Monitor(mcfg) as mon:
        result = run_grpo(cfg, mon)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = SAMPLED + (DIST if top_k else ())
    row = {"model": model, "dtype": dtype, "fault": spec or "clean", "top_k": top_k, "steps": result.steps_run,
           "wall_s": time.perf_counter() - t0,
           "metrics": {k: statistics.fmean(x["metrics"][k] for x in lines) for k in keys},
           "alarm_steps": sorted({a.step for r in result.reports for a in r.alarms}),
           "diagnose": diagnose(run_dir).verdict.cause,
           "seconds": {p: statistics.fmean(t.get(p, 0.0) for t in result.timings[1:]) for p in PHASES}}
    print(json.dumps(row), flush=True)
    return row


def kernel_row(repeats: int = 7) -> dict:
    """Seconds of one `chunked_token_logprobs` call (no grad) with and without the top-k outputs: the
    two interleaved, the minimum of `repeats` each (the machine is shared)."""
    import torch

    from rlcheck.trainers.logprobs import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    n, h, v, k = 2048, 512, 32768, 20
    hidden, weight = torch.randn(n, h, generator=g), 0.05 * torch.randn(v, h, generator=g)
    targets, ids = torch.randint(0, v, (n,), generator=g), torch.randint(0, v, (n, k), generator=g)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with torch.no_grad():
        for _ in range(repeats):
            for label, kw in (("off", {}), ("on", {"top_k": k, "topk_ids": ids})):
                t = time.perf_counter()
                chunked_token_logprobs(hidden, weight, targets, **kw)
                times[label].append(time.perf_counter() - t)
    return {"rows": n, "vocab": v, "hidden": h, "k": k, "seconds": {x: min(ts) for x, ts in times.items()},
            "threads": torch.get_num_threads()}


def table(data: dict) -> str:
    head = ("| model | dtype | fault | abs_diff_mean | diff_mean | dist/kl_mean | dist/kl_max | topk_overlap | "
            "top1_agree | tail rollout / train | alarm steps | diagnose |")
    lines = [head, "|" + "---|" * 12]
    for r in data["cases"]:
        if not r["top_k"]:
            continue
        m = r["metrics"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['fault']} | {m[SAMPLED[0]]:.2e} | {m[SAMPLED[1]]:+.2e} | "
                     f"{m[DIST[0]]:.2e} | {m[DIST[1]]:.2e} | {m[DIST[2]]:.3f} | {m[DIST[3]]:.3f} | "
                     f"{m[DIST[4]]:.3f} / {m[DIST[5]]:.3f} | {r['alarm_steps'] or '-'} | {r['diagnose']} |")
    lines += ["", "| model | top-k | " + " | ".join(PHASES) + " |", "|" + "---|" * (2 + len(PHASES))]
    for r in data["cases"]:
        if r["fault"] == "clean" and r["dtype"] == "float32":
            lines.append(f"| {r['model']} | {r['top_k'] or 'off'} | "
                         + " | ".join(f"{r['seconds'][p]:.3f}" for p in PHASES) + " |")
    kr = data.get("kernel")
    if kr:
        lines += ["", f"kernel ({kr['rows']} rows, vocab {kr['vocab']}, {kr['threads']} threads): "
                  f"{kr['seconds']['off'] * 1e3:.1f} ms off, {kr['seconds']['on'] * 1e3:.1f} ms with top-{kr['k']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlcheck-topk"))
    ap.add_argument("--json", type=Path, default=Path("benchmarks/data/topk.json"))
    ap.add_argument("--only", default=None, help="run only the cases whose model-dtype-fault name contains this")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    if args.table_only:
        print(table(json.loads(args.json.read_text())))
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rlcheck.loop import ray_session

    data = {"command": " ".join(["benchmarks/bench_topk.py", *(argv or sys.argv[1:])]), "steps": args.steps,
            "kernel": kernel_row(), "cases": []}
    cases = [c for c in CASES if args.only is None or args.only in f"{c[0]}-{c[1]}-{c[2] or 'clean'}"]
    with ray_session(num_cpus=4, log_to_driver=False):
        for model, dtype, spec, top_k in cases:
            data["cases"].append(run_case(model, dtype, spec, top_k, args.steps, args.out))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1))
    print(table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
