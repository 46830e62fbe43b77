"""Stress and sweep on the real vLLM CPU engine: requests per second of `rlcheck stress`, what each
fault leaves, and the wall time of a 5-value sweep.

    .venv/bin/python benchmarks/bench_stress.py [--archs mamba2,hybrid] [--requests 2000] [--fault-requests 512]
        [--sweep-requests 256] [--sweep max_num_seqs=4,8,16,32,64] [--sweep-inject index-wrap=16]

Per arch: build the tiny model (`rlcheck.modelzoo`, fp32), load the HF reference once, then
- a clean stress run of --requests requests (8 per prompt, 8 tokens, max_num_seqs 64, 8 MiB cache),
  twice (the first engine of a process pays the CPU kernels' warm-up on every new batch shape):
  seconds of engine start (+ prompts), generation and replay, requests per second end to end and of
  generation alone, failures and the largest |d|;
- one run per fault on --fault-requests requests (index-wrap at boundary max_num_seqs / 2): failures,
  whether they are exactly the fault's own affected ids, first failing arrival index, first wave;
- a sweep of --sweep under --sweep-inject on --sweep-requests requests: wall time, and per value the
  failures. One run each (the machine is shared; generation times vary by ~2x between runs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def row(name: str, res) -> str:
    s = res.seconds
    exact = set(res.failing_request_ids) == set(res.fault_affected)
    wave = "-" if res.first_wave is None else f"{res.first_wave[1]}/{res.first_wave[0]}"
    return (f"| {name} | {res.num_requests} | {res.num_blocks} | {s['build']:.1f} | {s['generate']:.1f} | "
            f"{s['score']:.1f} | {res.requests_per_second:.1f} | {res.num_requests / s['generate']:.1f} | "
            f"{len(res.failing)} | {'yes' if exact else 'no'} | {res.first_failing_index} | {wave} | "
            f"{max(m for m in res.max_abs_diff):.2g} |")


def bench_arch(arch: str, args) -> None:
    from rlcheck.forensics.render import show_value
    from rlcheck.forensics.replay import load_scorer
    from rlcheck.forensics.stress import StressConfig, parse_inject, run_stress
    from rlcheck.forensics.sweep import parse_knob, run_sweep
    from rlcheck.modelzoo import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(arch, os.path.join(tmp, arch)))
        scorer = load_scorer(model)
        print(f"\n### {arch}\n")
        print("| run | requests | blocks | start s | generate s | replay s | requests/s | generated/s | failing | "
              "= fault's ids | first failing | first wave failing | max abs d |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        base = StressConfig(model=model, num_requests=args.requests)
        for when in ("first in the process", "again"):
            print(row(f"clean, {when}", run_stress(base, scorer=scorer)), flush=True)
        for fault in ("stale-state", "index-wrap"):
            cfg = StressConfig(model=model, num_requests=args.fault_requests, fault=fault)
            print(row(f"{fault} (boundary {cfg.fault_boundary})" if cfg.fault_boundary else fault,
                      run_stress(cfg, scorer=scorer)), flush=True)
        fault, boundary = parse_inject(args.sweep_inject)
        knob = parse_knob(args.sweep)
        base = StressConfig(model=model, num_requests=args.sweep_requests, fault=fault, boundary=boundary)
        start = time.perf_counter()
        res = run_sweep(base, [knob], scorer=scorer)
        wall = time.perf_counter() - start
        cells = ", ".join(f"{show_value(p.knob, p.value)}: {p.num_failing}/{p.num_requests} "
                          f"(first {p.first_failing_index})" for p in res.points)
        print(f"\nsweep {args.sweep} under {args.sweep_inject}, {args.sweep_requests} requests per value: "
              f"{wall:.1f} s for {len(res.points)} values ({wall / len(res.points):.1f} s each); failing: {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="mamba2")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--fault-requests", type=int, default=512)
    ap.add_argument("--sweep-requests", type=int, default=256)
    ap.add_argument("--sweep", default="max_num_seqs=4,8,16,32,64")
    ap.add_argument("--sweep-inject", default="index-wrap=16")
    args = ap.parse_args()
    print(f"stress bench: {os.cpu_count()} CPUs, {args.requests} clean requests")
    for arch in args.archs.split(","):
        bench_arch(arch, args)


if __name__ == "__main__":
    main()
