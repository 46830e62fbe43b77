"""Overhead of the engine guard on generation throughput: stress-like greedy vLLM generation with and
without `rlcheck.engines.guard`, on one engine, several repeats, medians.

    .venv/bin/python benchmarks/bench_guard.py [--archs mamba2,hybrid] [--requests 2000] [--repeats 5]

Per arch: build the tiny model (`rlcheck.modelzoo`, fp32) and one engine at the stress defaults (8 MiB
of cache, max_num_seqs 64, 8 tokens per request, EOS ignored, prompts of 4-16 random tokens, each
repeated 8 times); one warm-up pass; then `--repeats` rounds, each one pass without the guard and one
with it (installed by `install_guard`, policy "raise": a violation would stop the bench; the order
alternates per round so a drift of the machine's load hits both alike). Printed per arch: the median
wall seconds of a pass without and with the guard, requests per second, the overhead (median with /
median without - 1); the same in CPU seconds of the process (`time.process_time`, all threads: far
less sensitive than wall time to other jobs on a shared machine); and the guard's own time inside the
forward hook (its `seconds`, the part of the overhead that is the guard's work), per engine step, and
the violations (0 on a clean run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def one_pass(engine, prompts, guard_cfg) -> tuple[float, float, object]:
    """(wall s, CPU s) of one generate over every prompt, with a fresh guard when `guard_cfg` is given."""
    from rlcheck.engines.guard import install_guard

    guard = None if guard_cfg is None else install_guard(engine, guard_cfg)
    t, c = time.perf_counter(), time.process_time()
    engine.generate(prompts, step=0)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    if guard is not None:
        guard.close()
    return wall, cpu, guard


def bench_arch(arch: str, args) -> str:
    import numpy as np

    from rlcheck.engines.guard import GuardConfig
    from rlcheck.engines.vllm import VLLMConfig, VLLMEngine
    from rlcheck.forensics.stress import StressConfig, make_prompts
    from rlcheck.modelzoo import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(arch, os.path.join(tmp, arch)))
        scfg = StressConfig(model=model, num_requests=args.requests)
        prompts = make_prompts(scfg, np.arange(10, 2000))
        engine = VLLMEngine(VLLMConfig(model=model, greedy=True, max_tokens=scfg.max_tokens, sampling={"ignore_eos": True},
                                       max_model_len=scfg.max_model_len, max_num_seqs=scfg.max_num_seqs,
                                       kv_cache_bytes=scfg.kv_cache_bytes))
        try:
            one_pass(engine, prompts, None)  # warm-up: the CPU kernels' first batch shapes
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            own, steps, violations = [], [], 0
            cfg = GuardConfig(policy="raise", capacity=4096)
            for r in range(args.repeats):
                for with_guard in ((False, True) if r % 2 == 0 else (True, False)):
                    wall, cpu, guard = one_pass(engine, prompts, cfg if with_guard else None)
                    runs[with_guard].append((wall, cpu))
                    if guard is not None:
                        own.append(guard.seconds)
                        steps.append(guard.step)
                        violations += sum(guard.counts.values())
                print(f"  {arch} round {r}: without {runs[False][-1][0]:.2f} s wall / {runs[False][-1][1]:.2f} s CPU, "
                      f"with {runs[True][-1][0]:.2f} / {runs[True][-1][1]:.2f} (guard's own {own[-1]:.3f} s)", flush=True)
        finally:
            engine.close()
    (w_off, c_off), (w_on, c_on) = ([statistics.median(x[k] for x in runs[g]) for k in (0, 1)] for g in (False, True))
    m_own, m_steps = statistics.median(own), statistics.median(steps)
    return (f"| {arch} | {args.requests} | {args.repeats} | {w_off:.2f} / {w_on:.2f} | {args.requests / w_off:.0f} / "
            f"{args.requests / w_on:.0f} | {100 * (w_on / w_off - 1):+.1f}% | {c_off:.2f} / {c_on:.2f} | "
            f"{100 * (c_on / c_off - 1):+.1f}% | {m_own:.3f} ({100 * m_own / w_on:.1f}%) | {1e3 * m_own / m_steps:.2f} | "
            f"{m_steps:.0f} | {violations} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="mamba2,hybrid")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"guard bench: {os.cpu_count()} CPUs, {args.requests} requests per pass, {args.repeats} rounds")
    rows = [bench_arch(a, args) for a in args.archs.split(",")]
    print("\n| model | requests | rounds | wall s without / with (medians) | requests/s without / with | wall overhead | "
          "CPU s without / with (medians) | CPU overhead | guard's own s (of wall with) | guard ms per step | "
          "engine steps | violations |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
