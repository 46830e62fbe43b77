"""Confusion matrix of `rlcheck diagnose` over the whole fault zoo (issue 28): every fault of `FAULTS`,
old and new, and healthy runs, through the real loop (vLLM rollout actor, the hf trainer, Ray), on
seeds not used to write the rules; rows = the injected cause, columns = diagnose's first cause.

    .venv/bin/python benchmarks/bench_confusion.py --seeds 1 2 [--quick] [--out runs/confusion]
    .venv/bin/python benchmarks/bench_confusion.py --seeds 1 2 --diagnose-only   # the saved runs, diagnosed again
    .venv/bin/python benchmarks/bench_confusion.py --seeds 1 --only stop-token none   # some rows (spec prefixes)

Each run: `tiny_cpu` (8 prompts x 8 samples, fp32 on both sides) with the fault, the Monitor's defaults
but the robust-z warm-up at ONSET steps (as tests/integration/test_faults_loop.py); a fault that can
start late starts at ONSET, the others at step 0. A run ends when the Monitor halts, `AFTER` steps
after its first alarm, or at ONSET + `AFTER` + 4 steps (healthy runs run all of them); the loop keeps
the first alarmed step's dump (`rlcheck.loop.trainer_view`). Models: the trained tiny Llama for the
data-level and the new faults; the random hybrid for the Mamba faults, as tests/integration/
test_faults_loop.py runs them (on the trained hybrid's 3-token answers they leave no signature); the
trained MoE for moe-route-flip; the random Llama for retokenize (a trained model's samples are
canonical: nothing to re-tokenize); a healthy run on each, and on the trained hybrid (the demo's).
stale-state and index-wrap run with the engine guard (a spec ending in `+guard`), and a healthy hybrid
run with it. A finished run leaves `done.json` and is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LLAMA, HYBRID, MOE = "runs/models/llama-trained", "runs/models/hybrid-trained", "runs/models/moe-trained"
RANDOM, MAMBA = "runs/models/llama", "runs/models/hybrid"  # random weights (`rlcheck.modelzoo.build_model`)
GUARD = "+guard"
"""A spec ending in it runs with the engine guard (`tiny_cpu(guard=True)`, as `rlcheck demo --guard`): the
loop's only view of the scheduler's state slots, which tells stale state from index aliasing."""
CASES = [  # (spec, model); {onset} is the step the rolling detectors are warm at
    ("none", LLAMA), ("none", HYBRID), ("none", RANDOM), ("none", MAMBA), ("none+guard", MAMBA), ("none", MOE),
    ("skip-sync-every=4", LLAMA), ("stale-weights@{onset}", LLAMA), ("temperature-mismatch=1.1", LLAMA),
    ("top-p=0.9", LLAMA), ("off-by-one@{onset}", LLAMA), ("off-by-one-early@{onset}", LLAMA),
    ("bf16-noise=1@{onset}", LLAMA),
    ("corrupt-seqs=0.03@{onset}", LLAMA), ("drop-sync=mlp", LLAMA), ("permute-sync=self_attn", LLAMA),
    ("perturb-layer=1", LLAMA), ("stale-buffer", MAMBA), ("stale-state+guard", MAMBA), ("index-wrap=16+guard", MAMBA),
    ("moe-route-flip=0.1", MOE),
    ("retokenize", RANDOM), ("double-bos", LLAMA), ("left-pad-positions@{onset}", LLAMA), ("stop-token", LLAMA),
    ("stale-prefix-cache@{onset}", LLAMA), ("rope-mismatch=4", RANDOM), ("raw-logprobs", LLAMA),
]
RULE_SEEDS = (0, 1, 2, 3)
"""The seeds the rules were written on (the loop's seed: prompts, sampling, trainer, fault): 0 (quick); 1,
whose two misses (raw-logprobs: 83% of the likely tokens one-signed, under the first 90% bar; corrupt-seqs
on the trained Llama: 0.01 nats off, under the first 0.5) moved two thresholds; 2, whose one miss
(corrupt-seqs read as growth, 0.8, above the few-rows rule's 0.75) raised that rule to 0.85; 3, whose one
miss (stale-prefix-cache one update after the cache: some shared rows at 9e-5, under the 1e-4 floor of the
rows' separation) put that cut between the two groups. Held out: 4, 5."""


class StopRun(Exception):
    """Raised by the step callback to end a run early (enough steps after its first alarm)."""


def run_dir_of(out: Path, seed: int, spec: str, model: str) -> Path:
    return out / f"seed{seed}" / f"{Path(model).name}-{spec.replace('@', '_at').replace('+', '-')}"


def run_one(spec: str, model: str, seed: int, out: Path, onset: int, after: int) -> dict:
    from rlcheck.core.detect import DetectorsConfig, RobustZConfig
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.faults import parse_inject
    from rlcheck.loop import GRPOLoop
    from rlcheck.loop.presets import tiny_cpu

    spec = spec.format(onset=onset)
    run_dir = run_dir_of(out, seed, spec, model)
    fault_spec, guard = spec.removesuffix(GUARD), spec.endswith(GUARD)
    fault = parse_inject(None if fault_spec == "none" else fault_spec, seed=seed)
    cfg = tiny_cpu(model, trainer="hf", steps=onset + after + 4, fault=fault, seed=seed, guard=guard)
    first: list[int] = []
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short before: start it over

    def on_step(step, report, info) -> None:
        if report.alarms and not first:
            first.append(step)
        if first and step >= first[0] + after and not info.get("halted"):
            raise StopRun

    t0, result, error = time.perf_counter(), None, None
    detectors = DetectorsConfig(robust_z=RobustZConfig(warmup=onset))
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context=cfg.context(), detectors=detectors)) as mon:
        loop = GRPOLoop(cfg, mon)
        try:
            result = loop.run(on_step)
        except StopRun:
            pass
        except Exception as exc:  # noqa: BLE001 - a run that fails is a row of the table, not the end of it
            error = f"{type(exc).__name__}: {exc}"
        finally:
            loop.close()
    done = {"spec": spec, "model": model, "seed": seed, "cause": fault.cause, "guard": guard, "seconds": round(time.perf_counter() - t0, 1),
            "halted": bool(result is not None and result.halted), "first_alarm": first[0] if first else None, "error": error}
    (run_dir / "done.json").write_text(json.dumps(done))
    return done


def diagnosed(run_dir: Path) -> dict:
    from rlcheck.forensics.diagnose import diagnose

    done = json.loads((run_dir / "done.json").read_text())
    d = diagnose(run_dir)
    records = len((run_dir / "metrics.jsonl").read_text().splitlines())
    return {**done, "steps": records, "verdict": d.verdict.cause, "confidence": round(d.verdict.confidence, 2),
            "also": [f.cause for f in d.findings[1:3]]}


def matrix(rows: list[dict]) -> str:
    """The confusion matrix as a markdown table: rows the injected cause, columns the diagnosed one."""
    truth = sorted({r["cause"] for r in rows}, key=lambda c: (c != "healthy", c))
    said = sorted({r["verdict"] for r in rows}, key=lambda c: (c != "healthy", c not in truth, c))
    counts = Counter((r["cause"], r["verdict"]) for r in rows)
    lines = ["| injected \\ diagnosed | " + " | ".join(said) + " | right |", "|---" * (len(said) + 2) + "|"]
    for t in truth:
        n = sum(counts[(t, s)] for s in said)
        cells = [f"**{counts[(t, s)]}**" if s == t and counts[(t, s)] else str(counts[(t, s)] or ".") for s in said]
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {counts[(t, t)]}/{n} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=Path("runs/confusion"))
    ap.add_argument("--quick", action="store_true", help="warm-up ONSET 8, 3 steps after the first alarm (else 12 and 5)")
    ap.add_argument("--diagnose-only", action="store_true", help="diagnose the saved runs, run nothing")
    ap.add_argument("--only", nargs="*", default=None, help="the cases whose spec starts with one of these")
    args = ap.parse_args()
    onset, after = (8, 3) if args.quick else (12, 5)
    cases = [(s, m) for s, m in CASES if args.only is None or any(s.startswith(p) for p in args.only)]
    if not args.diagnose_only:
        _run_all(cases, args.seeds, args.out, onset, after)
    found = sorted(args.out.glob("seed*/*/done.json"))
    rows = [diagnosed(p.parent) for p in found if int(p.parent.parent.name.removeprefix("seed")) in args.seeds]
    for r in rows:
        mark = "ok " if r["verdict"] == r["cause"] else "XX "
        print(f"{mark}seed {r['seed']} {Path(r['model']).name:15s} {r['spec']:28s} -> {r['verdict']} ({r['confidence']}) "
              f"steps {r['steps']} first alarm {r['first_alarm']} halted {r['halted']} {r['seconds']} s"
              + (f" ERROR {r['error']}" if r["error"] else ""))
    print(f"\nseeds {args.seeds} (rules written on seeds {list(RULE_SEEDS)}), {len(rows)} runs\n")
    print(matrix(rows))


def _run_all(cases, seeds, out: Path, onset: int, after: int) -> None:
    from rlcheck.loop import ray_session
    from rlcheck.modelzoo import build_model, ensure_trained

    for path, arch in ((LLAMA, "llama"), (HYBRID, "hybrid"), (MOE, "moe")):
        ensure_trained(path, arch)
    for path, arch in ((RANDOM, "llama"), (MAMBA, "hybrid")):
        if not (Path(path) / "config.json").is_file():
            build_model(arch, path)
    with ray_session(num_cpus=4, log_to_driver=False):
        for seed in seeds:
            for spec, model in cases:
                if (run_dir_of(out, seed, spec.format(onset=onset), model) / "done.json").is_file():
                    continue
                done = run_one(spec, model, seed, out, onset, after)
                print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
