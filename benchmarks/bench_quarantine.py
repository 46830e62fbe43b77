"""Quarantine on synthetic field streams (`rlcheck.synthetic.field`): does it take out exactly the
corrupted sequences, and never a healthy one?

    .venv/bin/python benchmarks/bench_quarantine.py --out benchmarks/data/quarantine_bench.json
    .venv/bin/python benchmarks/bench_quarantine.py --only corrupt --corrupt-seeds calibration

Corrupt: the `--base` healthy scenario's FieldConfig with `--num-sequences` 200 a step, and in each of
`--steps` 300 observations exactly one random sequence corrupted the field's corrupt-seqs way
(confident gibberish from one of its first 3 tokens: from there the trainer finds each token 2-4 nats
less likely; `FieldFault("corrupt-seqs")` draws each sequence with a probability, so it cannot place
exactly one). Through a Monitor with `QuarantineConfig()` (defaults otherwise; a halt is counted and
the run goes on): precision and recall of the quarantined request ids against the corrupted ones,
alarms and halts; then the same stream through the default Monitor without quarantine, stopped at
its first halt. Run on the calibration seeds (where this bench was developed) and on the held-out
seeds (the figures reported); the JSON says which is which.
Healthy: every scenario of `SCENARIOS`, whole, on the first `--healthy-seeds` (2: 15,080 observations;
all 5 take ~20 min on 2 shared cores) held-out seeds, with quarantine on (two-ranks:
the ranks' batches concatenated, as rank 0 judges every rank's sequences; resumed: a new Monitor at
each restart): every healthy sequence quarantined is listed with its numbers (there should be none).
Overhead: mean `rlcheck/monitor/seconds` with and without quarantine on one healthy scenario (and on
the corrupted stream, where quarantine also writes a dump each step; halting off there, so the run
without quarantine goes on). Run dirs go to a tmpfs (/dev/shm) so the fsyncs do not time the disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.config import HaltConfig, MonitorConfig
from rlcheck.core.monitor import Monitor
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.errors import MismatchHalt
from rlcheck.synthetic.field import FieldStream
from rlcheck.synthetic.scenarios import CALIBRATION_SEEDS, HELD_OUT_SEEDS, SCENARIOS, TEST_SEEDS, run_scenario

SEEDS = {"calibration": CALIBRATION_SEEDS, "held-out": HELD_OUT_SEEDS, "test": TEST_SEEDS}
TMP = "/dev/shm" if os.path.isdir("/dev/shm") else None


def config(run_dir: str, quarantine: QuarantineConfig | None, halt: bool = True) -> MonitorConfig:
    return MonitorConfig(run_dir=run_dir, sinks=("jsonl",), quarantine=quarantine,
                         halt=HaltConfig() if halt else HaltConfig(enabled=False))


def whole_step(stream: FieldStream, i: int) -> StepBatch:
    """Observation i of `stream`, every rank's sequences in rank order."""
    batches = stream.batches(i)
    return batches[0] if len(batches) == 1 else StepBatch.concat(batches)


def corrupt_one(batch: StepBatch, seed: int, i: int) -> tuple[StepBatch, int, int]:
    """`batch` with one random sequence corrupted (from one of its first 3 tokens, each token 2-4
    nats less likely to the trainer): (batch, its index, the first corrupted position)."""
    rng = np.random.default_rng([seed, i, 0xC0])
    cu, lr = batch.cu_seqlens, batch.logp_rollout
    k = int(rng.integers(batch.num_sequences))
    a, b = int(cu[k]), int(cu[k + 1])
    p = int(rng.integers(0, min(3, b - a)))
    lt = batch.logp_train.copy()
    lt[a + p : b] = lr[a + p : b] - rng.uniform(2.0, 4.0, b - a - p)
    return dataclasses.replace(batch, logp_train=lt), k, p


def observe(mon: Monitor, step: int, batch: StepBatch):
    """(report, halted) of one observation; a halt is caught."""
    try:
        return mon.observe(step, batch), False
    except MismatchHalt as halt:
        return halt.report, True


def alarm_names(alarms) -> list[str]:
    return [f"{a.kind}/{a.details.get('signature', a.metric)}/{a.severity}" for a in alarms]


def corrupt_stream(base: str, seed: int, steps: int, num_sequences: int):
    """(stream, a generator of (i, step, batch, corrupted index, start)) of the corrupted run."""
    s = SCENARIOS[base]
    stream = FieldStream(dataclasses.replace(s.field, num_sequences=num_sequences, seed=seed), None, steps)
    return ((i, stream.step(i), *corrupt_one(whole_step(stream, i), seed, i)) for i in range(steps))


def run_corrupt(base: str, seed: int, steps: int, num_sequences: int) -> dict:
    """The corrupted run with quarantine on: precision, recall, misses, alarms, halts."""
    run_dir = tempfile.mkdtemp(dir=TMP)
    tp = fp = 0
    missed, wrong, alarms, halts, seconds = [], [], Counter(), [], []
    with Monitor(config(run_dir, QuarantineConfig())) as mon:
        for i, step, batch, k, p in corrupt_stream(base, seed, steps, num_sequences):
            report, halted = observe(mon, step, batch)
            got = {q.index: q for q in report.quarantined}
            tp += k in got
            fp += len(got) - (k in got)
            if k not in got:
                missed.append({"observation": i, "index": k, "length": int(batch.seq_lens[k]), "start": p})
            wrong += [{"observation": i, **q.to_dict()} for j, q in got.items() if j != k]
            alarms.update(alarm_names(report.alarms))
            halts += [i] if halted else []
            seconds.append(report.metrics[K.MONITOR_SECONDS])
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"seed": seed, "observations": steps, "corrupted": steps, "quarantined": tp + fp, "true_positives": tp,
            "precision": tp / max(tp + fp, 1), "recall": tp / steps, "missed": missed, "false_quarantines": wrong,
            "alarms": dict(alarms), "halts": halts, "monitor_seconds_mean": float(np.mean(seconds))}


def run_unquarantined(base: str, seed: int, steps: int, num_sequences: int) -> dict:
    """The same corrupted run through the default Monitor, stopped at its first halt."""
    run_dir = tempfile.mkdtemp(dir=TMP)
    first_alarm = halt = None
    with Monitor(config(run_dir, None)) as mon:
        for i, step, batch, _, _ in corrupt_stream(base, seed, steps, num_sequences):
            report, halted = observe(mon, step, batch)
            if report.alarms and first_alarm is None:
                first_alarm = {"observation": i, "alarms": alarm_names(report.alarms)}
            if halted:
                halt = {"observation": i, "step": step, "alarms": alarm_names(report.alarms),
                        "reason": report.halt_reason}
                break
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"seed": seed, "first_alarm": first_alarm, "halt": halt}


def corrupt_rows(label: str, seeds: tuple[int, ...], args) -> dict:
    runs, without = [], []
    for seed in seeds:
        runs.append(run_corrupt(args.base, seed, args.steps, args.num_sequences))
        without.append(run_unquarantined(args.base, seed, args.steps, args.num_sequences))
        r, w = runs[-1], without[-1]
        halt = f"halt at observation {w['halt']['observation']}" if w["halt"] else "no halt"
        print(f"  corrupt {label} seed {seed}: precision {r['precision']:.4f} recall {r['recall']:.4f}, "
              f"{len(r['halts'])} halts; without quarantine: {halt}", file=sys.stderr)
    tp = sum(r["true_positives"] for r in runs)
    quarantined = sum(r["quarantined"] for r in runs)
    corrupted = sum(r["corrupted"] for r in runs)
    return {"seeds_are": label, "seeds": list(seeds), "base": args.base, "num_sequences": args.num_sequences,
            "steps": args.steps, "corrupted": corrupted, "quarantined": quarantined, "true_positives": tp,
            "precision": tp / max(quarantined, 1), "recall": tp / max(corrupted, 1),
            "halts": sum(len(r["halts"]) for r in runs), "runs": runs, "without_quarantine": without}


def healthy_scenario(name: str, seed: int) -> dict:
    """One healthy scenario, whole, quarantine on: every quarantined sequence with its numbers."""
    run_dir = tempfile.mkdtemp(dir=TMP)
    found, alarms, seqs = [], Counter(), [0]

    def seen(i: int, batch: StepBatch, report) -> None:
        found.extend({"seed": seed, "observation": i, **q.to_dict(), **tail_counts(batch, q.index)}
                     for q in report.quarantined)
        alarms.update(alarm_names(report.alarms))
        seqs[0] += batch.num_sequences

    result = run_scenario(SCENARIOS[name], seed, run_dir, monitor_config=lambda d: config(d, QuarantineConfig()),
                          whole_batch=True, on_step=seen)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"observations": len(result.steps), "sequences": seqs[0], "quarantined": found, "alarms": alarms,
            "halts": result.halts}


def tail_counts(batch: StepBatch, k: int) -> dict:
    """Tokens of sequence k past 0.5 and at or past 2 nats, and the positions of the first few."""
    a, b = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
    ad = np.abs(batch.logp_train[a:b].astype(np.float64) - batch.logp_rollout[a:b])
    return {"tokens_past_0.5": int((ad > 0.5).sum()), "tokens_past_2": int((ad >= 2.0).sum()),
            "positions_past_0.5": np.flatnonzero(ad > 0.5)[:10].tolist()}


def healthy_rows(names: list[str], seeds: tuple[int, ...]) -> list[dict]:
    rows = []
    for name in names:
        t0 = time.perf_counter()
        runs = [healthy_scenario(name, seed) for seed in seeds]
        alarms = sum((r["alarms"] for r in runs), Counter())
        row = {"scenario": name, "seeds": list(seeds), "observations": sum(r["observations"] for r in runs),
               "sequences": sum(r["sequences"] for r in runs),
               "quarantined": [q for r in runs for q in r["quarantined"]],
               "alarms": dict(alarms), "halts": sum(len(r["halts"]) for r in runs),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"  healthy {name}: {len(row['quarantined'])} quarantined of {row['sequences']} sequences, "
              f"{row['halts']} halts in {row['observations']} observations", file=sys.stderr)
    return rows


def mean_seconds(batches, quarantine: QuarantineConfig | None) -> float:
    """Mean monitor seconds over `batches()` ((step, batch) pairs), halting off."""
    run_dir = tempfile.mkdtemp(dir=TMP)
    with Monitor(config(run_dir, quarantine, halt=False)) as mon:
        seconds = [mon.observe(step, batch).metrics[K.MONITOR_SECONDS] for step, batch in batches()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return float(np.mean(seconds))


def overhead(args, seed: int) -> dict:
    """Mean monitor seconds with and without quarantine: a healthy scenario, and the corrupted stream."""
    s = SCENARIOS[args.overhead_scenario]
    num = min(args.overhead_steps, s.num_steps)
    stream = FieldStream(dataclasses.replace(s.field, seed=seed), None, s.num_steps)

    def healthy():
        return ((stream.step(i), whole_step(stream, i)) for i in range(num))

    def corrupted():
        return ((step, b) for _, step, b, _, _ in corrupt_stream(args.base, seed, num, args.num_sequences))

    out = {"seed": seed, "observations": num}
    for label, batches in ((args.overhead_scenario, healthy), (f"{args.base} x{args.num_sequences}, 1 corrupted", corrupted)):
        off, on = mean_seconds(batches, None), mean_seconds(batches, QuarantineConfig())
        row = {"off": off, "on": on, "ratio": on / off}
        if batches is corrupted:
            row["on_without_dump"] = mean_seconds(batches, QuarantineConfig(dump=False))
        out[label] = row
        print(f"  overhead {label}: {off * 1e3:.2f} ms off, {on * 1e3:.2f} ms on", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("corrupt", "healthy", "overhead", "all"), default="all")
    ap.add_argument("--corrupt-seeds", choices=("calibration", "held-out", "both"), default="both")
    ap.add_argument("--base", default="bf16-short", help="the healthy scenario the corrupted stream is built on")
    ap.add_argument("--num-sequences", type=int, default=200)
    ap.add_argument("--steps", type=int, default=300, help="observations of the corrupted run")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="healthy scenarios (held-out seeds)")
    ap.add_argument("--healthy-seeds", type=int, default=2, help="how many seeds of --healthy-set the healthy runs take")
    ap.add_argument("--healthy-set", choices=tuple(SEEDS), default="held-out",
                    help="the seed set of the healthy runs (test: 200, 201, never looked at while developing)")
    ap.add_argument("--overhead-scenario", default="bf16-long-cot")
    ap.add_argument("--overhead-steps", type=int, default=300)
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out: dict = {"seeds": {k: list(v) for k, v in SEEDS.items()}, "reported_seeds": "held-out"}
    if args.only in ("corrupt", "all"):
        labels = ("calibration", "held-out") if args.corrupt_seeds == "both" else (args.corrupt_seeds,)
        out["corrupt"] = [corrupt_rows(label, SEEDS[label], args) for label in labels]
    if args.only in ("healthy", "all"):
        out["healthy"] = healthy_rows(args.scenarios.split(","), SEEDS[args.healthy_set][: args.healthy_seeds])
        out["healthy_set"] = args.healthy_set
    if args.only in ("overhead", "all"):
        out["overhead"] = overhead(args, HELD_OUT_SEEDS[0])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print_summary(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def print_summary(out: dict) -> None:
    for c in out.get("corrupt", ()):
        halted = [w for w in c["without_quarantine"] if w["halt"]]
        at = sorted({w["halt"]["observation"] for w in halted})
        print(f"corrupt ({c['seeds_are']} seeds {c['seeds']}): {c['corrupted']} corrupted, {c['quarantined']} "
              f"quarantined, precision {c['precision']:.4f}, recall {c['recall']:.4f}, {c['halts']} halts with "
              f"quarantine; without: {len(halted)} of {len(c['seeds'])} runs halted, at observation(s) {at}")
    for h in out.get("healthy", ()):
        print(f"healthy {h['scenario']}: {len(h['quarantined'])} quarantined of {h['sequences']} sequences in "
              f"{h['observations']} observations, {h['halts']} halts, alarms {h['alarms'] or 'none'}")
    if "overhead" in out:
        print(f"overhead: {json.dumps(out['overhead'])}")
    print(f"{out['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
