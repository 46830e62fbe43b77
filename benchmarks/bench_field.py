"""Field fidelity: rlcheck's default Monitor on the field scenarios (`rlcheck.synthetic.scenarios`):
false alarms and halts of healthy runs, and the delays to the first alarm and to the halt of the
fault zoo laid on the bf16 baselines, with the anchors' gates on the same streams.

    .venv/bin/python benchmarks/bench_field.py                       # held-out seeds, everything
    .venv/bin/python benchmarks/bench_field.py --seeds calibration   # the seeds the defaults were set on
    .venv/bin/python benchmarks/bench_field.py --legacy              # the defaults before issue 14
    .venv/bin/python benchmarks/bench_field.py --only healthy --scenarios gapped,resumed
    .venv/bin/python benchmarks/bench_field.py --only real --real /work/field_data  # recorded real loops

Healthy: every scenario, each seed, the whole run with halting on (a halt is counted and the run goes
on). Faults: each fault of `FAULTS` on each of `FAULT_BASELINES`, first seed only, stopped at the halt
or `--after` observations past the onset. Delays are in observations after the onset (+0: the first
touched observation). Anchors, on the same step metrics: TRL mean |d| > 0.01 (TRL logs it and gates
nothing; 0.01 is the level of verl's gate), NeMo-RL mean e^|d| > 1.05, verl probs_diff_mean > 0.01.
Real: every run directory under `--real` holding a `tokens.npz` recorded by
`benchmarks/bench_real_loop.py --record` (healthy real loops, bf16 vLLM) is replayed step by step
through the default Monitor: its warn steps and halts on data no default was set on.
Run dirs go to a tmpfs (/dev/shm) so that the Monitor's fsyncs do not time the disk.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter

from rlcheck.core import metrics as K
from rlcheck.synthetic.scenarios import (
    CALIBRATION_SEEDS,
    FAULT_BASELINES,
    FAULTS,
    HELD_OUT_SEEDS,
    SCENARIOS,
    ScenarioResult,
    run_scenario,
)

ANCHORS = (
    ("TRL mean |d| > 0.01", K.ABS_DIFF_MEAN, 0.01),
    ("NeMo-RL mean e^|d| > 1.05", K.MULT_PROB_ERROR, 1.05),
    ("verl probs diff > 0.01", K.PROB_ABS_DIFF_MEAN, 0.01),
)



_SCRATCH: list[str] = []


def scratch_dir() -> str:
    """A run directory on the tmpfs; the one before is removed (a run's results are read by then), and
    the last when the benchmark exits: left behind, a sweep's run dirs (up to ~40 MB each) filled
    10 GB of the machine's memory."""
    _remove_scratch()
    path = tempfile.mkdtemp(dir="/dev/shm")
    _SCRATCH.append(path)
    return path


@atexit.register
def _remove_scratch() -> None:
    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)

def legacy_config(run_dir):
    """The defaults before issue 14, as far as they still exist: catastrophic = max |d| >= 2, NeMo-RL's
    gate and raw mean |d| as warn rules, mean e^|d| > 2 as a hard limit (rolling detectors as now)."""
    from rlcheck.core.detect import DetectorsConfig, ThresholdConfig, ThresholdRule
    from rlcheck.core.monitor import HaltConfig, MonitorConfig
    from rlcheck.core.stats import StatsConfig

    rules = (ThresholdRule(K.MULT_PROB_ERROR, 1.05), ThresholdRule(K.PROB_ABS_DIFF_MEAN, 0.01),
             ThresholdRule(K.ABS_DIFF_MEAN, 0.05))
    limits = {K.NONFINITE_COUNT: 0.0, K.MULT_PROB_ERROR: 2.0, K.ABS_DIFF_MEAN: 1.0, K.SEQ_CATASTROPHIC_FRAC: 0.25}
    return MonitorConfig(
        run_dir=run_dir, sinks=("jsonl",),
        stats=StatsConfig(catastrophic_min_frac=1e-9, catastrophic_min_tokens=1),
        detectors=DetectorsConfig(threshold=ThresholdConfig(rules)), halt=HaltConfig(hard_limits=limits),
    )


def anchor_hits(r: ScenarioResult, metric: str, limit: float) -> list[int]:
    return [i for i, m in enumerate(r.metrics) if m.get(metric, 0.0) > limit]


def alarm_kinds(r: ScenarioResult, i: int | None, severity: str | None = None) -> str:
    if i is None:
        return ""
    kinds = sorted({f"{a['kind']}/{a['details'].get('signature', a['severity'])}" for a in r.alarms[i]
                    if severity is None or a["severity"] == severity})
    return f" ({', '.join(kinds)})"


def delay(i: int | None, onset: int, note: str = "") -> str:
    return "never" if i is None else f"+{i - onset}{note}"


def healthy_rows(names: list[str], seeds: tuple[int, ...], config) -> list[dict]:
    rows = []
    for name in names:
        s = SCENARIOS[name]
        obs = warn = halts = 0
        kinds: Counter = Counter()
        anchors = Counter()
        t0 = time.perf_counter()
        for seed in seeds:
            r = run_scenario(s, seed, scratch_dir(), monitor_config=config, keep_metrics=True)
            obs += len(r.steps)
            warn += r.warn_steps
            halts += len(r.halts)
            kinds.update(f"{a['kind']}/{a['details'].get('signature', a['metric'])}/{a['severity']}"
                         for al in r.alarms for a in al)
            for label, metric, limit in ANCHORS:
                anchors[label] += len(anchor_hits(r, metric, limit))
        rows.append({"scenario": name, "seeds": list(seeds), "observations": obs, "warn_steps": warn,
                     "halts": halts, "alarms": dict(kinds), "anchors": dict(anchors),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"  healthy {name}: {warn} warn steps, {halts} halts in {obs} observations", file=sys.stderr)
    return rows


def fault_rows(seed: int, after: int, config) -> list[dict]:
    rows = []
    for base in FAULT_BASELINES:
        for fault in FAULTS:
            s = dataclasses.replace(SCENARIOS[base], num_steps=fault.onset + after)
            r = run_scenario(s, seed, scratch_dir(), fault=fault, monitor_config=config,
                             stop_on_halt=True, keep_metrics=True)
            on = r.onset_observation if r.onset_observation is not None else fault.onset
            first, crit = r.first_alarm(on), r.first_alarm(on, "critical")
            halt = r.halts[0] if r.halts else None
            row = {
                "baseline": base, "fault": fault.name, "onset": on, "observations": len(r.steps),
                "touched": r.onset_observation is not None,
                "alarmed_before_onset": sum(1 for i in range(min(on, len(r.alarms))) if r.alarms[i]),
                "first_alarm": delay(first, on, alarm_kinds(r, first)),
                "first_critical": delay(crit, on, alarm_kinds(r, crit, "critical")),
                "halt": delay(halt, on),
            }
            for label, metric, limit in ANCHORS:
                hits = [i for i in anchor_hits(r, metric, limit) if i >= on]
                row[label] = delay(hits[0] if hits else None, on)
            rows.append(row)
            print(f"  {base} {fault.name}: alarm {row['first_alarm']}, halt {row['halt']}", file=sys.stderr)
    return rows


def real_batches(path):
    """(step, StepBatch) of every step recorded in `path`/tokens.npz, in order."""
    import numpy as np

    from rlcheck.core.batch import StepBatch

    z = np.load(path / "tokens.npz")
    cu, seq_cu = z["cu_seqlens"], z["step_seq_cu"]
    for j, step in enumerate(z["steps"].tolist()):
        a, b = int(seq_cu[j]), int(seq_cu[j + 1])
        t0, t1 = int(cu[a]), int(cu[b])
        yield step, StepBatch.from_packed(
            z["logp_rollout"][t0:t1], z["logp_train"][t0:t1], cu[a : b + 1] - t0,
            [f"s{step}-{i}" for i in range(b - a)], mask=z["mask"][t0:t1], tokens=z["tokens"][t0:t1].astype(np.int64))


def real_rows(root, config) -> list[dict]:
    from pathlib import Path

    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.errors import MismatchHalt

    rows = []
    for path in sorted(p for p in Path(root).iterdir() if (p / "tokens.npz").is_file()):
        run_dir = scratch_dir()
        cfg = (config or (lambda d: MonitorConfig(run_dir=d, sinks=("jsonl",))))(run_dir)
        obs = warn = halts = 0
        kinds: Counter = Counter()
        with Monitor(cfg) as mon:
            for step, batch in real_batches(path):
                try:
                    report = mon.observe(step, batch)
                except MismatchHalt as halt:
                    report, halts = halt.report, halts + 1
                obs += 1
                warn += any(a.severity == "warn" for a in report.alarms)
                kinds.update(f"{a.kind}/{a.details.get('signature', a.metric)}/{a.severity}" for a in report.alarms)
        rows.append({"scenario": f"real: {path.name}", "seeds": ["-"], "observations": obs, "warn_steps": warn,
                     "halts": halts, "alarms": dict(kinds), "anchors": {}})
        print(f"  real {path.name}: {warn} warn steps, {halts} halts in {obs} steps", file=sys.stderr)
    return rows


def print_tables(healthy: list[dict], faults: list[dict]) -> None:
    if healthy:
        print("| scenario | seeds | observations | steps with a warn alarm | halts | alarms (kind/name/severity: count) "
              "| " + " | ".join(a[0] + " (steps)" for a in ANCHORS) + " |")
        print("|---|---|---|---|---|---|" + "---|" * len(ANCHORS))
        for r in healthy:
            pct = 100.0 * r["warn_steps"] / max(r["observations"], 1)
            alarms = ", ".join(f"{k}: {v}" for k, v in sorted(r["alarms"].items())) or "none"
            anchors = " | ".join(f"{r['anchors'].get(a[0], 0)} ({100.0 * r['anchors'].get(a[0], 0) / r['observations']:.1f}%)"
                                 if r["anchors"] else "-" for a in ANCHORS)
            print(f"| {r['scenario']} | {','.join(map(str, r['seeds']))} | {r['observations']} | {r['warn_steps']} "
                  f"({pct:.2f}%) | {r['halts']} | {alarms} | {anchors} |")
        print()
    if faults:
        cols = ["baseline", "fault", "onset", "alarmed_before_onset", "first_alarm", "first_critical", "halt"]
        print("| " + " | ".join(cols + [a[0] for a in ANCHORS]) + " |")
        print("|" + "---|" * (len(cols) + len(ANCHORS)))
        for r in faults:
            print("| " + " | ".join(str(r[c]) for c in cols + [a[0] for a in ANCHORS]) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", choices=("held-out", "calibration"), default="held-out")
    ap.add_argument("--only", choices=("healthy", "faults", "real", "all"), default="all")
    ap.add_argument("--real", default="/work/field_data", help="recorded real loops (tokens.npz per run dir)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--after", type=int, default=200, help="observations run past a fault's onset")
    ap.add_argument("--legacy", action="store_true", help="the defaults before issue 14")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    seeds = HELD_OUT_SEEDS if args.seeds == "held-out" else CALIBRATION_SEEDS
    config = legacy_config if args.legacy else None
    t0 = time.perf_counter()
    healthy = healthy_rows(args.scenarios.split(","), seeds, config) if args.only in ("healthy", "all") else []
    if args.only in ("real", "all") and os.path.isdir(args.real):
        healthy += real_rows(args.real, config)
    faults = fault_rows(seeds[0], args.after, config) if args.only in ("faults", "all") else []
    print_tables(healthy, faults)
    print(f"\n{time.perf_counter() - t0:.0f} s; seeds {args.seeds} {seeds}{'; legacy defaults' if args.legacy else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"healthy": healthy, "faults": faults, "seeds": seeds, "legacy": args.legacy}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
