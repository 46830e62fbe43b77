"""Confusion matrix of `rlcheck diagnose` over the multi-turn faults (issue 39), through the real loop on
the calculator task (`tiny_cpu(task="calculator")`: vLLM rollout actor, 3-turn tool-calling episodes
token-in/token-out, the hf trainer, Ray); rows = the injected cause, columns = diagnose's first cause.

    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 0 1 [--quick] [--out runs/confusion-turns]
    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 2 3 --diagnose-only
    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 2 --only stale-turn none
    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 0 2 --mask-only --only none retokenized stripped

Each run as `run_one` runs it (the Monitor's defaults but the robust-z warm-up at ONSET
steps, the first alarmed step's dump kept, the run ended `AFTER` steps past its first alarm): every fault
starts at ONSET, so each run has a healthy stretch before it; healthy runs on the calculator model run all
ONSET + AFTER + 4 steps. The model is the tiny Llama trained on the calculator's dialogues
(runs/models/llama-calculator, `ensure_trained(..., task="calculator")`). The rules were written on
`RULE_SEEDS`; the matrix of the other seeds is the held-out one, printed apart.

`--mask-only`: the monitor's batches keep only the runs of the loss mask as turns, without the engine's
per-call prompts (`TurnRecord`s), as verl's agent loop and OpenRLHF hand them over; runs under
`<out>/mask-only`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from bench_confusion import StopRun, matrix  # noqa: E402 (a sibling script)

CALCULATOR = "runs/models/llama-calculator"
CASES = [(spec, CALCULATOR) for spec in (
    "none", "retokenized-history@{onset}", "stripped-history@{onset}", "missing-generation-prompt@{onset}",
    "join-token-mask@{onset}", "tool-tokens-in-loss@{onset}", "turn-logprobs-missing@{onset}", "stale-turn@{onset}")]
RULE_SEEDS = (0, 1)
"""The seeds the multi-turn rules were written on; held out: every other seed."""
GUARD = "+guard"


def run_dir_of(out: Path, seed: int, spec: str, model: str) -> Path:
    return out / f"seed{seed}" / f"{Path(model).name}-{spec.replace('@', '_at').replace('+', '-')}"


def mask_only() -> contextlib.AbstractContextManager:
    """The own loop's batches as a framework without per-call prompts has them: turns = the mask's runs."""
    from rlcheck.loop.agent.view import EpisodeView

    step_batch = EpisodeView.step_batch

    def runs_only(self, *args, **kwargs):
        return step_batch(self, *args, **kwargs).with_turns("mask_runs")

    return mock.patch.object(EpisodeView, "step_batch", runs_only)


def run_one(spec: str, model: str, seed: int, out: Path, onset: int, after: int, task: str = "addition") -> dict:
    from rlcheck.core.detect import DetectorsConfig, RobustZConfig
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.faults import parse_inject
    from rlcheck.loop import GRPOLoop
    from rlcheck.loop.presets import tiny_cpu

    spec = spec.format(onset=onset)
    run_dir = run_dir_of(out, seed, spec, model)
    fault_spec, guard = spec.removesuffix(GUARD), spec.endswith(GUARD)
    fault = parse_inject(None if fault_spec == "none" else fault_spec, seed=seed)
    cfg = tiny_cpu(model, trainer="hf", steps=onset + after + 4, fault=fault, seed=seed, guard=guard, task=task)
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
    done = {"spec": spec, "model": model, "seed": seed, "cause": fault.cause, "guard": guard, "task": task,
            "seconds": round(time.perf_counter() - t0, 1),
            "halted": bool(result is not None and result.halted), "first_alarm": first[0] if first else None, "error": error}
    (run_dir / "done.json").write_text(json.dumps(done))
    return done


def diagnosed(run_dir: Path) -> dict:
    """done.json with diagnose's verdict."""
    from rlcheck.forensics.diagnose import diagnose

    done = json.loads((run_dir / "done.json").read_text())
    d = diagnose(run_dir)
    records = len((run_dir / "metrics.jsonl").read_text().splitlines())
    return {**done, "steps": records, "verdict": d.verdict.cause, "confidence": round(d.verdict.confidence, 2),
            "also": [f.cause for f in d.findings[1:3]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", type=Path, default=Path("runs/confusion-turns"))
    ap.add_argument("--quick", action="store_true", help="ONSET 4, 2 steps after the first alarm (else 8 and 3)")
    ap.add_argument("--diagnose-only", action="store_true", help="diagnose the saved runs, run nothing")
    ap.add_argument("--only", nargs="*", default=None, help="the cases whose spec starts with one of these")
    ap.add_argument("--mask-only", action="store_true", help="turns from the loss mask alone, no per-call prompts")
    args = ap.parse_args()
    if args.mask_only:
        args.out = args.out / "mask-only"
    onset, after = (4, 2) if args.quick else (8, 3)
    cases = [(s, m) for s, m in CASES if args.only is None or any(s.startswith(p) for p in args.only)]
    if not args.diagnose_only:
        with mask_only() if args.mask_only else contextlib.nullcontext():
            _run_all(cases, args.seeds, args.out, onset, after)
    rows = [diagnosed(p.parent) for p in sorted(args.out.glob("seed*/*/done.json"))
            if int(p.parent.parent.name.removeprefix("seed")) in args.seeds]
    for r in rows:
        mark = "ok " if r["verdict"] == r["cause"] else "XX "
        print(f"{mark}seed {r['seed']} {r['spec']:32s} -> {r['verdict']} ({r['confidence']}) steps {r['steps']} "
              f"first alarm {r['first_alarm']} halted {r['halted']} {r['seconds']} s"
              + (f" ERROR {r['error']}" if r["error"] else ""))
    for name, keep in (("calibration", lambda s: s in RULE_SEEDS), ("held out", lambda s: s not in RULE_SEEDS)):
        part = [r for r in rows if keep(r["seed"])]
        if part:
            print(f"\n{name} seeds {sorted({r['seed'] for r in part})}, {len(part)} runs\n")
            print(matrix(part))


def _run_all(cases, seeds, out: Path, onset: int, after: int) -> None:
    from rlcheck.loop import ray_session
    from rlcheck.modelzoo import ensure_trained

    ensure_trained(CALCULATOR, "llama", task="calculator")
    with ray_session(num_cpus=4, log_to_driver=False):
        for seed in seeds:
            for spec, model in cases:
                if (run_dir_of(out, seed, spec.format(onset=onset), model) / "done.json").is_file():
                    continue
                print(json.dumps(run_one(spec, model, seed, out, onset, after, task="calculator")), flush=True)


if __name__ == "__main__":
    main()
