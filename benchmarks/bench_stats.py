"""Cost of `rlcheck.core.stats.compute` per training step, against two yardsticks.

For each (tokens, sequences) case it builds one synthetic float32 step (heavy-tailed sequence
lengths, logp_train = logp_rollout + N(0, 1e-3) plus a few outliers) and reports, best of --repeat:

    validate   StepBatch.from_packed (validation) on the prebuilt arrays
    rlcheck    rlcheck.core.stats.compute on the prebuilt StepBatch, numpy path (StatsConfig(backend="numpy"))
    backends   the same per --backend (rlcheck.core.stats.backend): numpy, torch-eager (torch on the
               CPU, the numpy arrays read zero-copy), torch (token pass through torch.compile; the first
               call, compilation included, reported apart), cuda (the batch built from CUDA tensors,
               StepBatch.device_tensors; when a GPU is present); each with its ratio to subtract
    subtract   one numpy pass over both arrays, np.subtract(logp_train, logp_rollout): the floor
    padded     the verl/TRL way in torch on CPU: the batch padded to [B, max_len] with a response
               mask, masked means over the padded tensors, torch.quantile on the masked values
               (pad = time to build the padded tensors, reported apart)
    memory     peak of rlcheck.core.stats.compute: tracemalloc (numpy allocations) and the ru_maxrss rise

Run:  .venv/bin/python benchmarks/bench_stats.py [--tokens 4e6,16e6] [--seqs 1000,16000] [--out x.json]
      [--backend numpy,torch-eager,torch,cuda]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import time
import tracemalloc

import numpy as np
import torch

from rlcheck.core.batch import StepBatch
from rlcheck.core.stats import StatsConfig, compute

PAD_BYTES_PER_ELEMENT = 37  # peak of pad() + padded_metrics() per [B, T] element, measured on this machine


def make_step(num_tokens: int, num_seqs: int, sigma: float, seed: int = 0):
    """(logp_rollout, logp_train, cu_seqlens) float32/float32/int64 with lognormal lengths."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, sigma, num_seqs)
    lens = np.floor(w / w.sum() * num_tokens).astype(np.int64)  # (N,) some may be 0
    lens[rng.choice(num_seqs, num_tokens - int(lens.sum()), replace=False)] += 1
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    lr = -rng.exponential(1.5, num_tokens).astype(np.float32)  # (M,)
    lt = lr + rng.normal(0.0, 1e-3, num_tokens).astype(np.float32)
    np.minimum(lt, 0.0, out=lt)
    out = rng.choice(num_tokens, 32, replace=False)  # outliers: |d| in [1, 8], both signs
    delta = rng.uniform(1.0, 8.0, 32).astype(np.float32)
    lt[out[:16]] = lr[out[:16]] - delta[:16]
    lr[out[16:]] = lt[out[16:]] - delta[16:]
    return lr, lt, cu


def best_of(repeat: int, fn) -> float:
    """Fastest of `repeat` wall-clock runs of fn(), in seconds."""
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def pad(lr: np.ndarray, lt: np.ndarray, cu: np.ndarray):
    """(B, T) float32 padded logprobs and (B, T) bool response mask, as verl/TRL hold them."""
    lens = np.diff(cu)
    num_seqs, max_len = lens.shape[0], int(lens.max())
    row = np.repeat(np.arange(num_seqs, dtype=np.int64), lens)
    flat = torch.from_numpy(row * max_len + np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lens))
    out = []
    for x in (lr, lt):
        p = torch.zeros(num_seqs * max_len, dtype=torch.float32)
        p[flat] = torch.from_numpy(x)
        out.append(p.view(num_seqs, max_len))
    mask = torch.zeros(num_seqs * max_len, dtype=torch.bool)
    mask[flat] = True
    return out[0], out[1], mask.view(num_seqs, max_len)


def padded_metrics(lr, lt, mask, cfg: StatsConfig) -> dict[str, float]:
    """The core metrics the verl/TRL way: masked means over (B, T) tensors, padding included."""
    mask_f = mask.to(lr.dtype)  # (B, T)
    n = mask_f.sum()

    def masked_mean(x):
        return (x * mask_f).sum() / n

    d = lt - lr  # (B, T)
    ad = d.abs()
    ratio = torch.exp(torch.clamp(d, -20.0, 20.0))
    seq_max = ad.masked_fill(~mask, 0.0).amax(dim=1)  # (B,)
    out = {
        "abs_diff_mean": masked_mean(ad),
        "diff_mean": masked_mean(d),
        "kl_k3": masked_mean(ratio - 1.0 - d),
        "mult_prob_error": masked_mean(torch.exp(ad)),
        "prob_abs_diff_mean": masked_mean((torch.exp(lt) - torch.exp(lr)).abs()),
        "ratio_mean": masked_mean(ratio),
        "ratio_max": ratio.masked_fill(~mask, -torch.inf).amax(),
        "ratio_min": ratio.masked_fill(~mask, torch.inf).amin(),
        "seq_max_abs_diff_mean": seq_max.mean(),
        "seq_flagged_frac": (seq_max > cfg.divergence_tau).float().mean(),
    }
    for t in cfg.thresholds:
        out[f"frac_gt_{t:g}"] = masked_mean((ad > t).to(lr.dtype))
    vals = ad[mask]  # (M,)
    qs = torch.tensor([0.5, 0.9, 0.99])
    if vals.numel() <= 2**24:  # torch.quantile's input limit
        p50, p90, p99 = torch.quantile(vals, qs).tolist()
    else:
        s = vals.sort().values
        p50, p90, p99 = (s[int(q * (s.numel() - 1))].item() for q in qs)
    out.update(p50=p50, p90=p90, p99=p99)
    return {k: float(v) for k, v in out.items()}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def peak_memory(fn) -> tuple[float, float | None]:
    """(tracemalloc peak MiB, ru_maxrss rise MiB) of one fn() call. The rise needs Linux: freed heap
    goes back to the OS first (malloc_trim, so reused pages count), then /proc/self/clear_refs resets
    the peak RSS to the current RSS; elsewhere it is None."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        before = _rss_kib()
    except (OSError, AttributeError):
        before = None
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rise = None if before is None else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return peak / 2**20, rise


def run_case(num_tokens: int, num_seqs: int, args) -> dict:
    lr, lt, cu = make_step(num_tokens, num_seqs, args.sigma)
    ids = [f"req-{i}" for i in range(num_seqs)]
    cfg = StatsConfig(backend="numpy")
    batch = StepBatch.from_packed(lr, lt, cu, ids)
    row = {"tokens": num_tokens, "seqs": num_seqs, "max_len": int(np.diff(cu).max())}
    row["pad_factor"] = num_seqs * row["max_len"] / num_tokens
    row["validate_s"] = best_of(args.repeat, lambda: StepBatch.from_packed(lr, lt, cu, ids))
    row["rlcheck_s"] = best_of(args.repeat, lambda: compute(batch, cfg))
    row["subtract_s"] = best_of(args.repeat, lambda: np.subtract(lt, lr))
    row["ratio_rlcheck_subtract"] = row["rlcheck_s"] / row["subtract_s"]
    row["tracemalloc_peak_mib"], row["maxrss_rise_mib"] = peak_memory(lambda: compute(batch, cfg))
    row["backends"] = {name: time_backend(name, batch, lr, lt, cu, ids, row["subtract_s"], args)
                       for name in args.backend.split(",") if name}

    need_gib = num_seqs * row["max_len"] * PAD_BYTES_PER_ELEMENT / 2**30
    row["padded_need_gib"] = need_gib
    if args.no_padded:
        row["padded"] = "skipped (--no-padded)"
        return row
    if need_gib > args.pad_budget_gib:
        row["padded"] = f"skipped (memory): needs ~{need_gib:.1f} GiB > budget {args.pad_budget_gib:g} GiB"
        return row
    t0 = time.perf_counter()
    plr, plt, pmask = pad(lr, lt, cu)
    row["pad_build_s"] = time.perf_counter() - t0
    row["padded_s"] = best_of(args.repeat, lambda: padded_metrics(plr, plt, pmask, cfg))
    row["ratio_padded_rlcheck"] = row["padded_s"] / row["rlcheck_s"]
    ours, theirs = compute(batch, cfg)[0], padded_metrics(plr, plt, pmask, cfg)
    row["check_abs_diff_mean_rel"] = abs(theirs["abs_diff_mean"] / ours["rlcheck/token/abs_diff_mean"] - 1)
    row["check_p99_rel"] = abs(theirs["p99"] / ours["rlcheck/token/abs_diff_p99"] - 1)
    return row


def time_backend(name: str, batch, lr, lt, cu, ids, subtract_s: float, args) -> dict:
    """{"first_s", "best_s", "ratio_subtract"} of compute() through one backend ("cuda": the batch's
    tensors on the GPU; compute returns host floats, so the timing includes the device sync)."""
    if name == "cuda":
        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device"}
        dev = [torch.from_numpy(x).cuda() for x in (lr, lt, cu)]
        batch = StepBatch.from_packed(*dev, ids)
        cfg = StatsConfig(backend="torch-eager")
    else:
        cfg = StatsConfig(backend=name)
    t0 = time.perf_counter()
    got = compute(batch, cfg)[0]
    first = time.perf_counter() - t0
    best = best_of(args.repeat, lambda: compute(batch, cfg))
    ref = compute(batch, StatsConfig(backend="numpy"))[0]
    worst = max(abs(got[k] - v) / max(abs(v), 1e-12) for k, v in ref.items())  # against the numpy path
    return {"first_s": first, "best_s": best, "ratio_subtract": best / subtract_s, "max_rel_diff_numpy": worst}


def backend_table(rows: list[dict]) -> str:
    lines = ["| tokens | seqs | backend | ms | x subtract | first call s | max rel diff to numpy |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, b in r.get("backends", {}).items():
            if "skipped" in b:
                lines.append(f"| {r['tokens'] / 1e6:g}M | {r['seqs']} | {name} | {b['skipped']} | – | – | – |")
                continue
            lines.append(f"| {r['tokens'] / 1e6:g}M | {r['seqs']} | {name} | {b['best_s'] * 1e3:.1f} "
                         f"| {b['ratio_subtract']:.1f}x | {b['first_s']:.2f} | {b['max_rel_diff_numpy']:.1e} |")
    return "\n".join(lines)


def _fmt(row: dict, key: str, unit: float = 1e3, spec: str = ".0f") -> str:
    return format(row[key] * unit, spec) if key in row else "–"


def table(rows: list[dict]) -> str:
    head = (
        "| tokens | seqs | max len (pad x) | validate ms | rlcheck ms | subtract ms | rlcheck/subtract "
        "| pad build ms | padded ms | padded/rlcheck | tracemalloc peak MiB | maxrss rise MiB |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        padded = _fmt(r, "padded_s") if "padded_s" in r else r["padded"]
        rise = "n/a" if r["maxrss_rise_mib"] is None else f"{r['maxrss_rise_mib']:.0f}"
        lines.append(
            f"| {r['tokens'] / 1e6:g}M | {r['seqs']} | {r['max_len']} ({r['pad_factor']:.1f}x) "
            f"| {_fmt(r, 'validate_s')} | {_fmt(r, 'rlcheck_s')} | {_fmt(r, 'subtract_s', spec='.1f')} "
            f"| {r['ratio_rlcheck_subtract']:.1f}x | {_fmt(r, 'pad_build_s')} | {padded} "
            f"| {_fmt(r, 'ratio_padded_rlcheck', 1, '.2f') + 'x' if 'padded_s' in r else '–'} "
            f"| {r['tracemalloc_peak_mib']:.0f} | {rise} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4e6,16e6", help="comma-separated token counts per step")
    ap.add_argument("--seqs", default="1000,16000", help="comma-separated sequence counts per step")
    ap.add_argument("--repeat", type=int, default=3, help="runs per timing; the fastest is reported")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the sequence lengths")
    ap.add_argument("--pad-budget-gib", type=float, default=8.0, help="skip padded cases needing more")
    ap.add_argument("--backend", default="numpy,torch-eager,torch,cuda",
                    help="comma-separated stats backends to time (numpy, torch-eager, torch, cuda)")
    ap.add_argument("--no-padded", action="store_true", help="skip the padded (verl/TRL) rows")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for tokens in (int(float(t)) for t in args.tokens.split(",")):
        for seqs in (int(s) for s in args.seqs.split(",")):
            rows.append(run_case(tokens, seqs, args))
            gc.collect()
    print(table(rows))
    print()
    print(backend_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch_threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
