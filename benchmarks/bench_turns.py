"""Multi-turn rollouts (issue 39, item 8): the per-turn statistics' cost, detection power per multi-turn
fault, false alarms on long healthy multi-turn streams, and diagnose's verdict on each (the confusion
matrix's multi-turn rows at the batch level).

    .venv/bin/python benchmarks/bench_turns.py cost                       # per-turn stats vs none, same tokens
    .venv/bin/python benchmarks/bench_turns.py power --seeds 0 1 2        # calibration seeds
    .venv/bin/python benchmarks/bench_turns.py power --seeds 10 11 12     # held-out seeds
    .venv/bin/python benchmarks/bench_turns.py healthy --steps 10000 --seeds 0 1 10 11
    .venv/bin/python benchmarks/bench_turns.py spikes --seeds 10 11 12   # later-turn spikes: which detector sees them

cost: `compute_partial` of one multi-turn batch (synthetic, `rlcheck.synthetic.turns`, ~3.5 turns a
sequence) with its turns and with `turns=None`, the least CPU time (process time) of `--repeat` (+1) interleaved runs, numpy and eager torch on the host; and
the cross-turn invariants of the same batch (`rlcheck.core.turn_checks.check`, per-call prompts recorded).
power: each fault of `rlcheck.faults.turns` from step `ONSET` on a `MultiTurnStream` through the default
Monitor (quarantine on, `max_frac` 0.9, so the run goes on), with the engine's per-call prompts recorded
("explicit") and with turns from mask runs alone ("mask": verl, TRL): steps from the onset to the first
alarm about turns, alarms before the onset, then `rlcheck diagnose` on the run. healthy: the same Monitor on
a healthy stream: every alarm, by kind and metric. spikes: `later_spikes`, the default detectors on the
statistics of a healthy stream whose later turns spike. Run dirs on /dev/shm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.stats import StatsConfig, compute_partial
from rlcheck.core.turn_checks import check
from rlcheck.errors import MismatchHalt
from rlcheck.faults.turns import TURN_FAULTS
from rlcheck.forensics.diagnose import diagnose
from rlcheck.synthetic.field import FieldConfig
from rlcheck.synthetic.turns import MultiTurnConfig, MultiTurnStream

ONSET = 100
AFTER = 60


def about_turns(alarm) -> bool:
    return alarm.metric.startswith(K.TURN_PREFIX) or str(alarm.details.get("signature", "")).startswith("turn_")


def cost(sizes: list[int], repeat: int) -> list[dict]:
    rows = []
    for tokens in sizes:
        num = max(1, tokens // 450)
        cfg = MultiTurnConfig(field=FieldConfig(num_sequences=num, seed=0))
        batch = MultiTurnStream(cfg, num_steps=1).batch(0)
        plain = dataclasses.replace(batch, turns=None)
        for backend in ("numpy", "torch-eager"):
            stats = StatsConfig(backend=backend)
            times: dict[str, float] = {"single": float("inf"), "turns": float("inf")}
            for name, b in [("single", plain), ("turns", batch)] * (repeat + 1):  # interleaved: load drifts alike
                took = _timed(lambda b=b, stats=stats: compute_partial(b, stats))
                times[name] = min(times[name], took)
            checks = min(_timed(lambda b=batch: check(b, trainer_version=0)) for _ in range(repeat))
            rows.append({"tokens": batch.num_tokens, "sequences": num, "backend": backend,
                         "single_ms": 1e3 * times["single"], "turns_ms": 1e3 * times["turns"],
                         "ratio": times["turns"] / times["single"], "invariants_ms": 1e3 * checks})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _timed(fn) -> float:
    """CPU seconds of `fn()` (process time: a shared machine's other load does not count)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def run(fault, seed: int, mask_runs: bool, steps: int) -> dict:
    cfg = MultiTurnConfig(field=FieldConfig(num_sequences=16, seed=seed, growth_steps=max(steps, 10_000)),
                          mask_runs=mask_runs)
    stream = MultiTurnStream(cfg, fault=fault, num_steps=steps)
    run_dir = tempfile.mkdtemp(prefix="bench-turns-", dir="/dev/shm")
    alarms: list[tuple[int, str, str, bool]] = []
    halted = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mon = Monitor(MonitorConfig(run_dir, sinks=(), quarantine=QuarantineConfig(max_frac=0.9)))
            try:
                for i in range(steps):
                    report = mon.observe(i, stream.batch(i), trainer_version=stream.trainer_version(i))
                    alarms += [(i, a.kind, a.metric, about_turns(a)) for a in report.alarms]
                    if fault is not None and i >= ONSET + AFTER:
                        break
            except MismatchHalt as exc:
                halted = i
                alarms += [(i, a.kind, a.metric, about_turns(a)) for a in exc.report.alarms]
            mon.close()
        verdict = diagnose(run_dir).verdict
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    onset = ONSET if fault is not None else steps
    caught = [s for s, _, _, turn in alarms if turn and s >= onset]
    before = [(s, k, m) for s, k, m, _ in alarms if s < onset]
    return {"fault": fault.name if fault is not None else "healthy", "seed": seed,
            "mode": "mask" if mask_runs else "explicit", "steps_to_alarm": caught[0] - onset if caught else None,
            "alarms_before_onset": len(before), "alarm_steps_before_onset": len({s for s, _, _ in before}),
            "kinds_before_onset": dict(Counter(f"{k}:{m.removeprefix(K.PREFIX)}" for _, k, m in before)),
            "halted_at": halted, "diagnose": verdict.cause, "expected": fault.cause if fault else "healthy"}


def later_spikes(seed: int, factor: float, steps: int = 1000, every: int = 50) -> dict:
    """A healthy explicit stream whose turns >= 1 get `factor` x their mismatch on every `every`-th step (from
    step `every`): the spikes each detector catches, and its alarms on the other steps (the default
    detectors on the statistics, as the Monitor runs them; no invariant is broken)."""
    from rlcheck.core.detect import DetectorsConfig, build_detectors
    from rlcheck.core.stats import compute

    cfg = MultiTurnConfig(field=FieldConfig(num_sequences=16, seed=seed, growth_steps=10_000))
    stream = MultiTurnStream(cfg, num_steps=steps)
    detectors = build_detectors(DetectorsConfig())
    caught = {"turn": 0, "step_level": 0}
    spikes, other = 0, Counter()
    for i in range(steps):
        batch = stream.batch(i)
        spiked = i >= every and i % every == 0
        if spiked:
            later = ~batch.turns.tool & (batch.turns.index >= 1)
            lr = batch.logp_rollout
            lt = np.where(later, np.minimum(lr + factor * (batch.logp_train - lr), 0.0), batch.logp_train)
            batch = dataclasses.replace(batch, logp_train=lt)
            spikes += 1
        metrics, _ = compute(batch)
        alarms = [a for det in detectors.values() for a in det.update(i, metrics)]
        if spiked:
            caught["turn"] += any(a.metric.startswith(K.TURN_PREFIX) for a in alarms)
            caught["step_level"] += any(not a.metric.startswith(K.TURN_PREFIX) for a in alarms)
        else:
            other.update(f"{a.kind}:{a.metric.removeprefix(K.PREFIX)}" for a in alarms)
    return {"seed": seed, "factor": factor, "spikes": spikes, "caught_by_turn_detectors": caught["turn"],
            "caught_by_step_level": caught["step_level"], "alarms_other_steps": dict(other)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("cost", "power", "healthy", "spikes"))
    p.add_argument("--factors", type=float, nargs="+", default=[1.5, 2.0, 3.0, 5.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 4_000_000])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    if args.what == "cost":
        rows = cost(args.sizes, args.repeat)
    if args.what == "spikes":
        for seed in args.seeds:
            for factor in args.factors:
                rows.append(later_spikes(seed, factor))
                print(json.dumps(rows[-1]), flush=True)
        args.seeds = []
    for seed in args.seeds if args.what in ("power", "healthy") else ():
        for mask_runs in (False, True):
            faults = [None] if args.what == "healthy" else [cls(start=ONSET, seed=seed) for cls in TURN_FAULTS]
            for fault in faults:
                t = time.perf_counter()
                rows.append(run(fault, seed, mask_runs, args.steps if fault is None else ONSET + AFTER + 1))
                rows[-1]["seconds"] = round(time.perf_counter() - t, 1)
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
