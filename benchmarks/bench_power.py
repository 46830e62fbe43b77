"""Detector power on shapes the defaults were not tuned on (issue 28, item 4; `rlcheck.synthetic.power`),
and the false alarms of the same defaults on the healthy field scenarios.

    .venv/bin/python benchmarks/bench_power.py --out benchmarks/data/power_bench.json   # held-out seeds
    .venv/bin/python benchmarks/bench_power.py --seeds calibration                       # where it was set
    .venv/bin/python benchmarks/bench_power.py --before                                  # the defaults before

Periodic: `PARTIAL_SPIKES` through the default Monitor (`observe`, whole batch): periods from the
onset to the first periodic alarm, periodic alarms before it. Quarantine: `corrupt_tail` on every
`--every`-th observation of each field scenario (`judge` with `QuarantineConfig()`): recall, and the
healthy sequences of the same observations condemned; the missed tails by their tokens past
divergence_tau in the last 16 (none, one on an uncertain token, one on a near-certain one), and the
healthy sequences of the same shape (what a rule that caught those misses would condemn). Drift: `DRIFTS` through the default Monitor
with the probe batch passed each step (`observe(..., probe=)`): steps from the onset to the first
drift alarm and the engine's factor then. Healthy: every field scenario, whole batch and probe, the
first `--healthy-seeds` seeds, every observation: periodic and drift alarms, halts.
`--before`: the periodic detector on the clipped mean alone, no tail rule, no probe (the defaults
before this item). `--no-probe`: drift and healthy without the probe batch, as verl's adapter and the
plain Monitor API run (issue 37 item 5: the residual trend, `DetectorsConfig.residual_trend`, is what
can see the drift there). Run dirs go to a tmpfs (/dev/shm).

    .venv/bin/python benchmarks/bench_power.py --no-probe --only drift,healthy --healthy-seeds 5
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

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import DetectorsConfig, PeriodicConfig
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig, judge, tail_window
from rlcheck.core.stats import StatsConfig
from rlcheck.errors import MismatchHalt
from rlcheck.synthetic.field import FieldStream
from rlcheck.synthetic.power import DRIFTS, PARTIAL_SPIKES, corrupt_tail
from rlcheck.synthetic.scenarios import CALIBRATION_SEEDS, HELD_OUT_SEEDS, SCENARIOS

SEEDS = {"calibration": CALIBRATION_SEEDS, "held-out": HELD_OUT_SEEDS, "fresh": (300, 301, 302, 303, 304)}
"""`fresh`: seeds no default was chosen on and no earlier figure reported (the tail clause's lone
near-certain token was chosen after the held-out seeds had been seen)."""


def monitor_config(run_dir: str, before: bool) -> MonitorConfig:
    if not before:
        return MonitorConfig(run_dir=run_dir, sinks=("jsonl",))
    detectors = DetectorsConfig(periodic=PeriodicConfig(metrics=(K.ABS_DIFF_CLIPPED_MEAN,)), control_drift=None,
                                control_trend=None)
    return MonitorConfig(run_dir=run_dir, sinks=("jsonl",), detectors=detectors)


def run(field, fault, num_steps: int, seed: int, before: bool, probe: bool = True) -> list[list]:
    """Per observation: its alarms (kind, severity), through one Monitor (a halt is counted in the
    alarms and the run goes on under a new Monitor on a new run dir)."""
    stream = FieldStream(dataclasses.replace(field, seed=seed), fault, num_steps)
    run_dir = tempfile.mkdtemp(dir="/dev/shm")
    out, mon = [], None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(num_steps):
                if mon is None:
                    shutil.rmtree(run_dir, ignore_errors=True)
                    mon = Monitor(monitor_config(run_dir, before))
                batches = stream.batches(i)
                batch = batches[0] if len(batches) == 1 else StepBatch.concat(batches)
                scored = stream.probe_batch(i) if probe and not before else None
                try:
                    report = mon.observe(stream.step(i), batch, probe=scored)
                    out.append([(a.kind, a.severity) for a in report.alarms])
                except MismatchHalt as halt:
                    out.append([(a.kind, a.severity) for a in halt.report.alarms] + [("halt", "critical")])
                    mon = None
    finally:
        if mon is not None:
            mon.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def first(alarms: list[list], kind: str, after: int) -> int | None:
    return next((i for i in range(after, len(alarms)) if any(k == kind for k, _ in alarms[i])), None)


def periodic_rows(seeds, before: bool) -> list[dict]:
    s, rows = PARTIAL_SPIKES, []
    for seed in seeds:
        alarms = run(s.field, s.fault, s.num_steps, seed, before)
        on, at = s.fault.onset, first(alarms, "periodic", s.fault.onset)
        rows.append({"seed": seed, "periods_to_alarm": None if at is None else (at - on) / s.fault.every,
                     "periodic_before_onset": sum(any(k == "periodic" for k, _ in a) for a in alarms[:on])})
        print(f"  periodic seed {seed}: {rows[-1]}", file=sys.stderr)
    return rows


def drift_rows(seeds, before: bool, probe: bool = True) -> list[dict]:
    rows = []
    for s in DRIFTS:
        for seed in seeds:
            alarms = run(s.field, s.fault, s.num_steps, seed, before, probe)
            on, at = s.fault.onset, first(alarms, "drift", s.fault.onset)
            halt = first(alarms, "halt", on)
            rows.append({"shape": s.name, "seed": seed, "steps_to_drift": None if at is None else at - on,
                         "factor_at_drift": None if at is None else round(s.fault.engine_factor(at), 2),
                         "halt_step": None if halt is None else halt - on,
                         "drift_before_onset": sum(any(k == "drift" for k, _ in a) for a in alarms[:on])})
            print(f"  drift {rows[-1]}", file=sys.stderr)
    return rows


def tail_counts(batch: StepBatch, span: int = 16, confident_p: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """(N,) each sequence's tokens past divergence_tau among its last `span`, and how many of those the
    engine gave at least `confident_p`: the shape of a corrupted tail the tail clause misses (at most
    one such token), counted on the healthy sequences too."""
    tail, confident = tail_window(batch, span, confident_p)
    past = tail > StatsConfig().divergence_tau
    return past.sum(axis=1), (past & confident).sum(axis=1)


def quarantine_rows(seeds, every: int, before: bool) -> list[dict]:
    cfg = QuarantineConfig(tail_span=None) if before else QuarantineConfig()
    shapes = [(n, s.field, s.num_steps) for n, s in SCENARIOS.items()] + [("partial-spikes base", PARTIAL_SPIKES.field, PARTIAL_SPIKES.num_steps)]
    rows = []
    for name, field, num_steps in shapes:
        caught = corrupted = healthy = condemned = 0
        missed = {"none_past_tau": 0, "one_past_tau_uncertain": 0, "one_past_tau_confident": 0, "more": 0}
        shaped = {"one_past_tau_uncertain": 0, "one_past_tau_confident": 0}  # healthy sequences shaped like a miss
        for seed in seeds:
            stream = FieldStream(dataclasses.replace(field, seed=seed), None, num_steps)
            for i in range(0, num_steps, every):
                whole = stream.batches(i)
                whole = whole[0] if len(whole) == 1 else StepBatch.concat(whole)
                v = judge(whole, StatsConfig(), cfg)
                healthy += whole.num_sequences
                condemned += v.count
                past, confident = tail_counts(whole)
                shaped["one_past_tau_uncertain"] += int(np.count_nonzero((past == 1) & (confident == 0)))
                shaped["one_past_tau_confident"] += int(np.count_nonzero((past == 1) & (confident == 1)))
                batch, k = corrupt_tail(whole, seed, i)
                hit = not judge(batch, StatsConfig(), cfg).keep[k]
                caught += hit
                corrupted += 1
                if not hit:
                    past, confident = (int(a[k]) for a in tail_counts(batch))
                    missed["none_past_tau" if past == 0 else "more" if past > 1 else
                           "one_past_tau_confident" if confident else "one_past_tau_uncertain"] += 1
        rows.append({"scenario": name, "corrupted": corrupted, "recall": caught / corrupted,
                     "healthy_sequences": healthy, "healthy_quarantined": condemned,
                     "missed": missed, "healthy_shaped_like_a_miss": shaped})
        print(f"  quarantine {rows[-1]}", file=sys.stderr)
    return rows


def healthy_rows(seeds, before: bool, probe: bool = True) -> list[dict]:
    rows = []
    for name, s in SCENARIOS.items():
        counts = {"observations": 0, "periodic": 0, "drift": 0, "halts": 0}
        for seed in seeds:
            alarms = run(s.field, None, s.num_steps, seed, before, probe)
            counts["observations"] += len(alarms)
            for kind, key in (("periodic", "periodic"), ("drift", "drift"), ("halt", "halts")):
                counts[key] += sum(any(k == kind for k, _ in a) for a in alarms)
        rows.append({"scenario": name, "seeds": list(seeds), **counts})
        print(f"  healthy {rows[-1]}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", choices=tuple(SEEDS), default="held-out")
    ap.add_argument("--only", default="periodic,quarantine,drift,healthy")
    ap.add_argument("--every", type=int, default=4, help="quarantine: every n-th observation")
    ap.add_argument("--healthy-seeds", type=int, default=2)
    ap.add_argument("--before", action="store_true")
    ap.add_argument("--no-probe", action="store_true", help="drift and healthy without the probe batch")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    seeds, only, t0 = SEEDS[args.seeds], args.only.split(","), time.perf_counter()
    out = {"seeds_are": args.seeds, "seeds": list(seeds), "calibration_seeds": list(CALIBRATION_SEEDS),
           "before": args.before, "probe": not args.no_probe}
    if "periodic" in only:
        out["periodic"] = periodic_rows(seeds, args.before)
    if "quarantine" in only:
        out["quarantine"] = quarantine_rows(seeds, args.every, args.before)
    if "drift" in only:
        out["drift"] = drift_rows(seeds, args.before, not args.no_probe)
    if "healthy" in only:
        out["healthy"] = healthy_rows(seeds[: args.healthy_seeds], args.before, not args.no_probe)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
