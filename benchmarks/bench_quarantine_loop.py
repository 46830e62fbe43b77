"""Quarantine in the real loop: does masking a few corrupted sequences keep a run going without hurting
it, and does it still stop a broken engine?

    .venv/bin/python benchmarks/bench_quarantine_loop.py [--out /tmp/rlcheck-quarantine] [--steps 60]
    .venv/bin/python benchmarks/bench_quarantine_loop.py --table-only   # re-read the run dirs

Per seed (0, 1, 2), `rlcheck.loop.run_grpo` with `tiny_cpu(model, trainer="hf")` (vLLM rollout actor,
one HF trainer rank; the random tiny hybrid by default, as `bench_detection.py`: on the demo's trained
hybrid the engine is so confident that `corrupt-seqs` (engine logprobs ~0) barely differs from the
truth) runs `--steps` steps:

- clean: no fault, the default Monitor;
- corrupt: `corrupt-seqs=0.02` (1 of the 32 sequences a step is confident gibberish), default Monitor;
- corrupt+quarantine: the same with `MonitorConfig(quarantine=QuarantineConfig())`, the quarantined
  sequences out of the loss;
- stale-state+quarantine: the engine's stale Mamba state fault with quarantine on.

From each run dir: steps run, the halt and its alarm kinds, the reward curve (`loop.jsonl`), and for
the corrupt runs the quarantined request ids against the ones the fault touched (precision, recall).
Writes `summary.json` and `rewards.png` (the reward curves: clean seeds' spread, the quarantined runs)
under `--out`; `--plot` copies the plot (docs/quarantine-rewards.png).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

MODES = ("clean", "corrupt", "corrupt+quarantine", "stale-state+quarantine")
FAULTS = {"clean": None, "corrupt": "corrupt-seqs=0.02", "corrupt+quarantine": "corrupt-seqs=0.02",
          "stale-state+quarantine": "stale-state"}
SEEDS = (0, 1, 2)


def run_case(mode: str, seed: int, steps: int, model: str, run_dir: Path) -> None:
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.core.quarantine import QuarantineConfig
    from rlcheck.faults import parse_inject
    from rlcheck.loop import run_grpo
    from rlcheck.loop.presets import tiny_cpu

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = tiny_cpu(model, trainer="hf", steps=steps, fault=parse_inject(FAULTS[mode], seed=seed), seed=seed)
    quarantine = QuarantineConfig() if mode.endswith("+quarantine") else None
    t0 = time.perf_counter()
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), resume=False, quarantine=quarantine,
                               context={"source": "bench_quarantine_loop", **cfg.context()})) as mon:
        result = run_grpo(cfg, mon)
    end = f"halted at step {result.steps_run - 1}" if result.halted else "no halt"
    print(f"  {mode} seed {seed}: {result.steps_run} steps, {end}, {time.perf_counter() - t0:.0f} s", flush=True)


def read_run(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "loop.jsonl").read_text().splitlines() if x.strip()]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    halt = next((x for x in lines if x.get("halted")), None)
    rewards = [x["reward_mean"] for x in lines if "reward_mean" in x]
    touched = {rid for x in lines if not x.get("halted") for rid in x.get("fault_touched") or ()}
    quarantined = {q["request_id"] for r in records for q in r.get("quarantined") or ()}
    halt_kinds = sorted({a["kind"] for a in records[-1]["alarms"] if a["severity"] == "critical"}) if halt else []
    if halt:  # and the step's other findings (a step past max_frac is judged whole)
        halt_kinds += sorted({f"{a['kind']}/{a['severity']}" for a in records[-1]["alarms"] if a["severity"] != "critical"})
    hit = touched & quarantined
    return {
        "steps": len(records), "halted": halt is not None, "halt_step": halt["step"] if halt else None,
        "halt_kinds": halt_kinds, "halt_reason": halt["reason"] if halt else None, "rewards": rewards,
        "touched": len(touched), "quarantined": len(quarantined),
        "precision": len(hit) / len(quarantined) if quarantined else None,
        "recall": len(hit) / len(touched) if touched else None,
        "quarantine_frac_max": max((r["metrics"].get("rlcheck/quarantine/frac", 0.0) for r in records), default=0.0),
        "alarms": sum(len(r["alarms"]) for r in records),
    }


def clean_band(found: dict[str, dict[str, dict]]) -> tuple[list[float], list[float]] | None:
    """Per step, the clean seeds' lowest and highest mean reward."""
    clean = [f["rewards"] for f in found.get("clean", {}).values()]
    if not clean:
        return None
    n = min(len(r) for r in clean)
    return [min(r[i] for r in clean) for i in range(n)], [max(r[i] for r in clean) for i in range(n)]


def table(found: dict[str, dict[str, dict]]) -> str:
    band = clean_band(found)
    rows = ["| run | seed | steps | halt | quarantined | touched by the fault | precision | recall | mean reward | "
            "steps inside the clean seeds' min-max |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for seed, f in sorted(found.get(mode, {}).items()):
            halt = f"step {f['halt_step']} ({', '.join(f['halt_kinds'])})" if f["halted"] else "no"
            r = f["rewards"]
            inside = "-"
            if band and mode != "clean":
                lo, hi = band
                k = min(len(r), len(lo))
                inside = f"{sum(lo[i] <= r[i] <= hi[i] for i in range(k))} of {k}"
            engine_fault = not f["touched"]  # stale-state acts inside vLLM: no per-request ground truth
            prec = "-" if f["precision"] is None or engine_fault else f"{f['precision']:.2f}"
            rec = "-" if f["recall"] is None else f"{f['recall']:.2f}"
            reward = f"{statistics.mean(r):.4f}" if r else "-"
            rows.append(f"| {mode} | {seed} | {f['steps']} | {halt} | {f['quarantined']} | {f['touched']} | {prec} | "
                        f"{rec} | {reward} | {inside} |")
    return "\n".join(rows)


def plot(found: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    clean = [f["rewards"] for f in found.get("clean", {}).values()]
    if clean:
        n = min(len(r) for r in clean)
        arr = np.array([r[:n] for r in clean])
        ax.fill_between(range(n), arr.min(0), arr.max(0), color="tab:gray", alpha=0.3, label="clean, 3 seeds (min-max)")
    for seed, f in sorted(found.get("corrupt+quarantine", {}).items()):
        ax.plot(f["rewards"], color="tab:blue", lw=1.2, label="corrupt-seqs=0.02, quarantine" if seed == "0" else None)
    for seed, f in sorted(found.get("corrupt", {}).items()):
        ax.plot(f["rewards"], color="tab:red", lw=1.5, marker="x", label="corrupt-seqs=0.02, no quarantine (halted)"
                if seed == "0" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on the tiny hybrid: quarantine keeps the run, the reward stays in the clean spread")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlcheck-quarantine"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", default="runs/models/hybrid")
    ap.add_argument("--only", nargs="*", default=None, help="modes to run (default: all)")
    ap.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--plot", type=Path, default=None, help="also copy the reward plot here")
    args = ap.parse_args(argv)
    if not args.table_only:
        from rlcheck.loop import ray_session
        from rlcheck.modelzoo import ensure_model

        model = str(ensure_model(Path(args.model)))
        t0 = time.perf_counter()
        with ray_session(num_cpus=4):
            for mode in args.only or MODES:
                for seed in args.seeds:
                    run_case(mode, seed, args.steps, model, args.out / f"{mode}-seed{seed}")
        print(f"ran in {time.perf_counter() - t0:.0f} s", flush=True)
    found: dict[str, dict[str, dict]] = {}
    for d in sorted(args.out.glob("*-seed*")):
        if (d / "loop.jsonl").exists():
            mode, seed = d.name.rsplit("-seed", 1)
            found.setdefault(mode, {})[seed] = read_run(d)
    (args.out / "summary.json").write_text(json.dumps(found, indent=1))
    print(table(found))
    plot(found, args.out / "rewards.png")
    if args.plot:
        shutil.copy(args.out / "rewards.png", args.plot)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
