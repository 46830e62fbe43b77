"""Load: one 1,000,000-token step through `Monitor.observe`, and 100,000-step histories in flat memory.

    big       2,000 sequences x 500 tokens (float32 logprobs, sampled and trainer token ids), observed
              --repeat times by a Monitor with the JSONL sink (fsynced line and state.json per step):
              seconds per observe, the peak memory observe adds (tracemalloc: numpy and Python
              allocations; RSS sampled every 2 ms), and the forensic dump of the step (what a halt writes)
    history   --steps small synthetic steps (rlcheck.synthetic, 8 sequences of ~32 tokens), each one's
              statistics (`rlcheck.core.stats.compute`) fed to every default detector; RSS and the
              detectors' state size (JSON bytes) every --every steps
    history --monitor
              the same steps through a whole `Monitor` (JSONL sink, halting off): each step adds a
              fsynced metrics line and an atomic, fsynced state.json, ~9 ms here, so 100,000 steps
              take ~15 min on this machine; run it with fewer --steps

Run:  .venv/bin/python benchmarks/bench_load.py big [--repeat 3]
      .venv/bin/python benchmarks/bench_load.py history [--steps 100000] [--every 10000] [--monitor]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import tempfile
import threading
import time
import tracemalloc

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import DetectorsConfig, build_detectors
from rlcheck.core.monitor import HaltConfig, Monitor, MonitorConfig
from rlcheck.core.stats import StatsConfig, compute
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


def rss() -> int:
    """Resident set size of this process now, in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def big_batch(num_seqs: int = 2000, length: int = 500, seed: int = 0) -> StepBatch:
    """num_seqs x length response tokens: 70% confident, 30% high-entropy; bf16-like noise."""
    rng = np.random.default_rng(seed)
    m = num_seqs * length
    confident = rng.random(m) < 0.7
    lr = np.maximum(np.where(confident, -rng.exponential(0.05, m), -rng.exponential(2.5, m)), -30.0).astype(np.float32)
    lt = np.minimum(lr + rng.normal(0.0, 2e-3, m) * (1.0 + np.abs(lr)), 0.0).astype(np.float32)  # (M,)
    cu = np.arange(num_seqs + 1, dtype=np.int64) * length
    tokens = rng.integers(0, 150_000, m)
    return StepBatch.from_packed(lr, lt, cu, [f"req-{i}" for i in range(num_seqs)], tokens=tokens, tokens_train=tokens)


class PeakRSS:
    """`with PeakRSS() as p:` samples RSS every `interval` s; p.peak is the highest seen."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, rss(), threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def run_big(repeat: int) -> dict:
    t0 = time.perf_counter()
    batch = big_batch()
    build_s = time.perf_counter() - t0
    out = {"num_tokens": batch.num_tokens, "num_sequences": batch.num_sequences, "build_s": build_s}
    with tempfile.TemporaryDirectory() as run_dir, Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
        times, peaks = [], []
        for step in range(repeat):
            gc.collect()
            base = rss()
            with PeakRSS() as p:
                t = time.perf_counter()
                report = mon.observe(step, batch)
                times.append(time.perf_counter() - t)
            peaks.append(p.peak - base)
        gc.collect()
        tracemalloc.start()
        mon.observe(repeat, batch)
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        t = time.perf_counter()
        where = mon.dump(repeat, batch, report, reason="benchmark")
        dump_s = time.perf_counter() - t
        dump_bytes = sum(f.stat().st_size for f in where.iterdir())
    out.update(observe_s=times, monitor_seconds=report.metrics["rlcheck/monitor/seconds"],
               peak_rss_added_mib=[x / MIB for x in peaks], tracemalloc_peak_mib=traced / MIB,
               batch_mib=batch_bytes(batch) / MIB, dump_s=dump_s, dump_mib=dump_bytes / MIB,
               max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def batch_bytes(batch: StepBatch) -> int:
    return sum(a.nbytes for a in (batch.logp_rollout, batch.logp_train, batch.cu_seqlens, batch.tokens,
                                  batch.tokens_train) if a is not None)


def run_history(steps: int, every: int, monitor: bool) -> dict:
    data = SyntheticConfig(num_sequences=8, mean_length=32)
    stats = StatsConfig()
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        mon = Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), halt=HaltConfig(enabled=False))) if monitor else None
        detectors = mon.detectors if mon else build_detectors(DetectorsConfig())
        num_alarms = 0
        for step in range(steps):
            batch = synthetic_batch(data, step)
            if mon:
                num_alarms += len(mon.observe(step, batch).alarms)
            else:
                metrics, _ = compute(batch, stats)
                num_alarms += sum(len(det.update(step, metrics)) for det in detectors.values())
            if (step + 1) % every == 0:
                state = {kind: det.state_dict() for kind, det in detectors.items()}
                rows.append({"step": step + 1, "rss_mib": rss() / MIB, "state_bytes": len(json.dumps(state)),
                             "alarms": num_alarms,
                             "seconds": time.perf_counter() - t0})
                print(json.dumps(rows[-1]), flush=True)
        if mon:
            mon.close()
            rows[-1]["jsonl_mib"] = os.path.getsize(os.path.join(run_dir, "metrics.jsonl")) / MIB
    return {"mode": "monitor" if monitor else "detectors", "steps": steps, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=("big", "history"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--monitor", action="store_true", help="history through a whole Monitor")
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args()
    result = run_big(args.repeat) if args.case == "big" else run_history(args.steps, args.every, args.monitor)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
