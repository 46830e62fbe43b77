"""Time and peak memory of token logprobs: naive log_softmax + gather, TRL's selective_log_softmax,
and `rlcheck.trainers.logprobs.chunked_token_logprobs`, forward only and forward + backward, on CPU.

    .venv/bin/python benchmarks/bench_logprobs.py                 # the BENCHMARKS.md table
    .venv/bin/python benchmarks/bench_logprobs.py --vocab 32768 --tokens 4096 --hidden 128
    .venv/bin/python benchmarks/bench_logprobs.py --modes fwd+bwd --methods naive rlcheck rlcheck:0

Methods: `naive`, `trl`, `rlcheck` (default `keep_bytes`), `rlcheck:B` (`keep_bytes=B`: B bytes per
logit of kept logits; `rlcheck:0` recomputes every chunk's logits in the backward).

Every (vocab, dtype, method, mode) case runs in its own subprocess: a warm-up call on tiny inputs,
inputs allocated, the RSS high-water mark (VmHWM) reset to the current RSS through
/proc/self/clear_refs, then the case runs `--repeats` times; peak = VmHWM after - before (the memory
the computation needed beyond its inputs; gradients of hidden and weight included in forward +
backward). Time is the best of the runs, wall (`time.perf_counter`) and CPU (`time.process_time`,
less moved by other processes)."""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time

METHODS = ("naive", "trl", "rlcheck")
MODES = ("fwd", "fwd+bwd")


def _logp(method: str, hidden, weight, targets):
    if method == "naive":  # the usual trainer code: float32 log-softmax of the full logits
        return (hidden @ weight.T).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    if method == "trl":  # TRL: full logits in the model dtype, then selective_log_softmax
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax(hidden @ weight.T, targets)
    from rlcheck.trainers.logprobs import chunked_token_logprobs

    kw = {"keep_bytes": float(method.split(":")[1])} if ":" in method else {}
    return chunked_token_logprobs(hidden, weight, targets, **kw).logp


def _warm_up(method: str, dtype) -> None:
    """Imports and first call on tiny inputs, before the baseline RSS: importing trl alone adds
    hundreds of MiB, and its first call seconds."""
    import torch

    _logp(
        method,
        torch.randn(4, 8, dtype=dtype),
        torch.randn(16, 8, dtype=dtype),
        torch.zeros(4, dtype=torch.long),
    )


def _peak_rss() -> int:
    """VmHWM, the RSS high-water mark (bytes) since the process started or the last reset."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> int:
    """Frees what malloc holds, resets VmHWM to the current RSS (Linux clear_refs), returns it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def run_case(
    vocab: int, tokens: int, hidden_size: int, dtype: str, method: str, backward: bool, repeats: int
) -> dict:
    import torch

    dt = getattr(torch, dtype)
    _warm_up(method, dt)
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size).to(dt).requires_grad_(backward)
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).to(dt).requires_grad_(backward)
    targets = torch.randint(0, vocab, (tokens,))
    base = _reset_peak_rss()
    times, cpu_times = [], []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.set_grad_enabled(backward):
            logp = _logp(method, hidden, weight, targets)
            if backward:
                logp.sum().backward()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        del logp
    peak = _peak_rss() - base
    return {"time_s": min(times), "cpu_s": min(cpu_times), "peak_mib": peak / 2**20}


def _subprocess(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {
            "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), help="naive, trl, rlcheck, rlcheck:B")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=3, help="runs per case; time is the best")
    p.add_argument("--case", nargs=7, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        v, n, h, dtype, method, bwd, reps = a.case
        print(json.dumps(run_case(int(v), int(n), int(h), dtype, method, bwd == "1", int(reps))))
        return
    print(
        "| vocab | tokens | dtype | mode | method | time s | cpu s | peak MiB | time / naive | cpu / naive "
        "| peak / naive |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in a.vocab:
        for dtype in a.dtypes:
            for bwd in ("1" if mode == "fwd+bwd" else "0" for mode in a.modes):
                res = {
                    m: _subprocess([str(v), str(a.tokens), str(a.hidden), dtype, m, bwd, str(a.repeats)])
                    for m in dict.fromkeys(["naive", *a.methods])
                }
                ref = res["naive"]
                for m, r in res.items():
                    mode = "fwd+bwd" if bwd == "1" else "fwd"
                    if "error" in r:
                        print(
                            f"| {v} | {a.tokens} | {dtype} | {mode} | {m} | error: {r['error']} | | | | | |"
                        )
                        continue
                    ratio = {
                        k: r[k] / ref[k] if k in ref else float("nan")
                        for k in ("time_s", "cpu_s", "peak_mib")
                    }
                    print(
                        f"| {v} | {a.tokens} | {dtype} | {mode} | {m} | {r['time_s']:.2f} | {r['cpu_s']:.2f} "
                        f"| {r['peak_mib']:.0f} | {ratio['time_s']:.2f}x | {ratio['cpu_s']:.2f}x "
                        f"| {ratio['peak_mib']:.3f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
