"""Confusion matrix of `rlcheck diagnose` over the multi-turn faults (issue 39), through the real loop on
the calculator task (`tiny_cpu(task="calculator")`: vLLM rollout actor, 3-turn tool-calling episodes
token-in/token-out, the hf trainer, Ray); rows = the injected cause, columns = diagnose's first cause.

    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 0 1 [--quick] [--out runs/confusion-turns]
    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 2 3 --diagnose-only
    .venv/bin/python benchmarks/bench_confusion_turns.py --seeds 2 --only stale-turn none

Each run as `bench_confusion.run_one` runs it (the Monitor's defaults but the robust-z warm-up at ONSET
steps, the first alarmed step's dump kept, the run ended `AFTER` steps past its first alarm): every fault
starts at ONSET, so each run has a healthy stretch before it; healthy runs on the calculator model run all
ONSET + AFTER + 4 steps. The model is the tiny Llama trained on the calculator's dialogues
(runs/models/llama-calculator, `ensure_trained(..., task="calculator")`). The rules were written on
`RULE_SEEDS`; the matrix of the other seeds is the held-out one, printed apart.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from bench_confusion import diagnosed, matrix, run_dir_of, run_one  # noqa: E402 (a sibling script)

CALCULATOR = "runs/models/llama-calculator"
CASES = [(spec, CALCULATOR) for spec in (
    "none", "retokenized-history@{onset}", "stripped-history@{onset}", "missing-generation-prompt@{onset}",
    "join-token-mask@{onset}", "tool-tokens-in-loss@{onset}", "turn-logprobs-missing@{onset}", "stale-turn@{onset}")]
RULE_SEEDS = (0, 1)
"""The seeds the multi-turn rules were written on; held out: every other seed."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--out", type=Path, default=Path("runs/confusion-turns"))
    ap.add_argument("--quick", action="store_true", help="ONSET 4, 2 steps after the first alarm (else 8 and 3)")
    ap.add_argument("--diagnose-only", action="store_true", help="diagnose the saved runs, run nothing")
    ap.add_argument("--only", nargs="*", default=None, help="the cases whose spec starts with one of these")
    args = ap.parse_args()
    onset, after = (4, 2) if args.quick else (8, 3)
    cases = [(s, m) for s, m in CASES if args.only is None or any(s.startswith(p) for p in args.only)]
    if not args.diagnose_only:
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
