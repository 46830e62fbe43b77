"""Is `left-pad-positions` on the demo's trained hybrid within a bf16 engine's noise? (issue 37: the one cell of
the seed-1 confusion matrix a fault read healthy). Runs `rlcheck demo`'s loop as `bench_confusion.py` does
(the healthy run, then the fault, in one loop per seed), every step dumped, and compares row by row.

    .venv/bin/python benchmarks/bench_pad_floor.py --seeds 1 2 3 --precision bf16 --out runs/pad-floor
    .venv/bin/python benchmarks/bench_pad_floor.py --seeds 1 2 3 --precision fp32 --out runs/pad-floor
    .venv/bin/python benchmarks/bench_pad_floor.py --out runs/pad-floor --report       # the table, run nothing
    .venv/bin/python benchmarks/bench_pad_floor.py --model moe-trained --seeds 1 2 --precision bf16 --out runs/pad-floor-moe

Per run and step: the clipped mean |d| (what the threshold gate reads) and, where the step has prompts shorter
than its longest (the rows the fault pads), the padded rows' mean |d| and its ratio to the other rows'. On
fp32 the healthy run sits at ~1e-7, so the fault's fp32 figures are its own size; on bf16 the healthy run's
figures are the noise the fault must stand out of, on the same kind of rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_confusion as bc  # noqa: E402 - the confusion bench's loop and cells

SPECS = ("none", "left-pad-positions")


def dump_every_step() -> None:
    """Every `Monitor.observe` also dumps its step (the rows diagnose and this bench read)."""
    from rlcheck.core.monitor import Monitor

    observe = Monitor.observe

    def observe_and_dump(self, step, batch, *args, **kwargs):
        report = observe(self, step, batch, *args, **kwargs)
        if not report.halted:
            self.dump(step, batch, report, reason="bench_pad_floor")
        return report

    Monitor.observe = observe_and_dump


def run(seeds, precision: str, trainer: str, steps: int, out: Path, model: str = "hybrid-trained",
        specs=SPECS) -> None:
    """`specs` that act through the loop's hooks share one loop per seed; the others (`bench_confusion.OWN`:
    engine faults such as stale-state) get their own."""
    from rlcheck.loop import ray_session

    dump_every_step()
    bc.AFTER = steps  # no early end after an alarm: every step of every run
    bc.ensure_models([model])
    with ray_session(num_cpus=4, log_to_driver=False):
        for seed in seeds:
            shared = [s for s in specs if s not in bc.OWN]
            if shared:
                bc.run_shared([bc.Cell(s, model, precision, trainer, seed) for s in shared], out, steps)
            for spec in (s for s in specs if s in bc.OWN):
                bc.run_own(bc.Cell(spec, model, precision, trainer, seed), out, steps)


def step_rows(dump: Path) -> dict:
    """One dumped step: its rows' mean |d|, split by whether the step's left padding reaches them."""
    import pandas as pd

    df = pd.read_parquet(dump / "sequences.parquet")
    lengths = np.array([len(p) for p in df.prompt_tokens])
    padded = lengths < lengths.max()
    row = np.array([np.abs(np.asarray(t, float) - np.asarray(r, float)).mean() if len(r) else 0.0
                    for r, t in zip(df.logp_rollout, df.logp_train, strict=True)])
    if not padded.any():
        return {}
    return {"padded": float(row[padded].mean()), "other": float(row[~padded].mean()), "rows": int(padded.sum())}


def collect(out: Path, model: str = "hybrid-trained") -> list[dict]:
    rows = []
    for run_dir in sorted(out.glob(f"seed*/{model}-*/*")):
        if not (run_dir / "done.json").is_file():
            continue
        done = json.loads((run_dir / "done.json").read_text())
        clipped = {json.loads(line)["step"]: json.loads(line)["metrics"]["rlcheck/token/abs_diff_clipped_mean"]
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
        for dump in sorted((run_dir / "dumps").glob("step_*")):
            step = int(dump.name.removeprefix("step_"))
            rows.append({"seed": done["seed"], "precision": done["precision"], "spec": done["spec"], "step": step,
                         "clipped": clipped.get(step), "alarm": done["first_alarm"], **step_rows(dump)})
    return rows


def auc(healthy: np.ndarray, fault: np.ndarray) -> float:
    """P(a fault step's figure > a healthy step's): 0.5 where the two cannot be told apart."""
    if not healthy.size or not fault.size:
        return float("nan")
    return float(np.mean([(f > healthy).mean() + 0.5 * (f == healthy).mean() for f in fault]))


def report(rows: list[dict]) -> str:
    lines = ["| precision | run | steps | clipped mean |d| per step (median, max) | padded rows' mean |d| (median, max) | "
             "padded / other rows (median, range) | first alarm |", "|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["precision"], r["spec"]), []).append(r)
    for (precision, spec), part in sorted(by.items()):
        clipped = np.array([r["clipped"] for r in part])
        pad = [r for r in part if "padded" in r]
        ratio = np.array([r["padded"] / max(r["other"], 1e-12) for r in pad])
        alarms = sorted({(r["seed"], r["alarm"]) for r in part})
        lines.append(f"| {precision} | {spec} | {len(part)} ({len(pad)} with padding) | {np.median(clipped):.2g}, "
                     f"{clipped.max():.2g} | {np.median([r['padded'] for r in pad]):.2g}, {max(r['padded'] for r in pad):.2g} | {np.median(ratio):.3g}, "
                     f"{ratio.min():.2g}-{ratio.max():.3g} | " + ", ".join(f"seed {s}: {a}" for s, a in alarms) + " |")
    for precision in sorted({r["precision"] for r in rows}):
        h = [r for r in rows if r["precision"] == precision and r["spec"] == "none" and "padded" in r]
        f = [r for r in rows if r["precision"] == precision and r["spec"] != "none" and "padded" in r]
        ratio = lambda part: np.array([r["padded"] / max(r["other"], 1e-12) for r in part])  # noqa: E731
        lines.append(f"\n{precision}: AUC of a fault step against a healthy one: padded/other ratio "
                     f"{auc(ratio(h), ratio(f)):.2f}, padded rows' mean |d| "
                     f"{auc(np.array([r['padded'] for r in h]), np.array([r['padded'] for r in f])):.2f}, clipped "
                     f"mean |d| {auc(np.array([r['clipped'] for r in rows if r['precision'] == precision and r['spec'] == 'none']), np.array([r['clipped'] for r in rows if r['precision'] == precision and r['spec'] != 'none'])):.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--precision", choices=list(bc.PRECISIONS), default="bf16")
    ap.add_argument("--trainer", choices=list(bc.TRAINERS), default="hf")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", choices=list(bc.MODELS), default="hybrid-trained")
    ap.add_argument("--out", type=Path, default=Path("runs/pad-floor"))
    ap.add_argument("--specs", nargs="+", default=list(SPECS), help="the runs (fault specs, none: healthy)")
    ap.add_argument("--report", action="store_true", help="the table of the finished runs, run nothing")
    args = ap.parse_args()
    if not args.report:
        run(args.seeds, args.precision, args.trainer, args.steps, args.out, args.model, tuple(args.specs))
    print(report(collect(args.out, args.model)))


if __name__ == "__main__":
    main()
