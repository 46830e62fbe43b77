"""Fit the stream model of healthy real-loop runs: what the rollout-vs-trainer mismatch looks like when
nothing is wrong (issue 14, item 1), from the per-token data `bench_real_loop.py` records.

    .venv/bin/python benchmarks/field_fit.py /work/field_data/*/ --out benchmarks/data/field_fit.json

Per run directory (tokens.npz, loop.jsonl, summary.json), with d = logp_train - logp_rollout over the
masked tokens and s = -logp_rollout (the sampled token's surprise under the engine):
(a) per-token |d|: quantiles, zero fraction, sign symmetry (mean d / mean |d|, share of d > 0), and
    its dependence on s: binned statistics, a power law mean|d| ~ a (1 + s)^b fitted to the bins, and
    a log-normal: log|d| ~ N(mu0 + mu1 log(1 + s), sigma) over the tokens with d != 0;
(b) tail tokens: the fraction with |d| > 0.5, 1, 2; per sequence, max |d| against length (binned,
    and a power law max|d| ~ c L^e), and the share of sequences whose max |d| >= 2;
(c) step to step: the per-step mean |d|, its coefficient of variation, the lag-1..5 autocorrelation
    of log(mean |d|) after a linear trend is removed;
(d) growth: the slope of log(mean |d|) against step (and the factor per 100 steps);
(e) per-step anchors: mean |d| (TRL), mean exp|d| (NeMo-RL's mult_prob_error), mean |p_t - p_r|
    (verl's probs_diff), seq catastrophic_frac (max |d| >= 2): median and max over steps;
plus the reward (first and last 20 steps; every step with --series) and the response lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}
TAIL_LEVELS = (0.5, 1.0, 2.0)
CATASTROPHIC = 2.0
SURPRISE_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0, np.inf)
LAGS = 5


def sig(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits (JSON stays small and readable)."""
    x = float(x)
    return x if x == 0 or not np.isfinite(x) else float(f"{x:.{digits}g}")


def load(run_dir: Path) -> dict:
    z = np.load(run_dir / "tokens.npz")
    data = {k: z[k] for k in z.files}
    data["loop"] = [json.loads(line) for line in (run_dir / "loop.jsonl").read_text().splitlines() if line.strip()]
    summary = run_dir / "summary.json"
    data["summary"] = json.loads(summary.read_text()) if summary.is_file() else {}
    return data


def token_fit(d: np.ndarray, s: np.ndarray) -> dict:
    """(a): quantiles of |d|, sign symmetry, and |d| against the surprise s."""
    ad = np.abs(d)
    out = {"num_tokens": int(len(d)), "zero_frac": sig(np.mean(ad == 0))}
    out["abs_d"] = {k: sig(np.quantile(ad, q)) for k, q in QUANTILES.items()} | {"max": sig(ad.max()),
                                                                                  "mean": sig(ad.mean())}
    out["sign"] = {"mean_d": sig(d.mean()), "mean_abs_d": sig(ad.mean()),
                   "mean_d_over_mean_abs_d": sig(d.mean() / max(ad.mean(), 1e-30)), "frac_pos": sig(np.mean(d > 0)),
                   "frac_neg": sig(np.mean(d < 0))}
    out["surprise"] = {k: sig(np.quantile(s, q)) for k, q in QUANTILES.items()} | {"mean": sig(s.mean())}
    bins, xs, ys, ws, qs = [], [], [], [], []
    for lo, hi in zip(SURPRISE_EDGES[:-1], SURPRISE_EDGES[1:], strict=True):
        sel = (s >= lo) & (s < hi)
        n = int(sel.sum())
        if n == 0:
            continue
        b = ad[sel]
        bins.append({"s_lo": lo, "s_hi": None if np.isinf(hi) else hi, "count": n, "s_mean": sig(s[sel].mean()),
                     "mean": sig(b.mean()), "p50": sig(np.median(b)), "p99": sig(np.quantile(b, 0.99)),
                     "max": sig(b.max()), "frac_gt_1": sig(np.mean(b > 1))})
        if b.mean() > 0:
            xs.append(np.log1p(s[sel].mean()))
            qs.append(np.log(np.mean(-np.expm1(-s[sel]))))  # log of the bin's mean 1 - p
            ys.append(np.log(b.mean()))
            ws.append(np.sqrt(n))
    out["by_surprise"] = bins
    if len(xs) >= 2:
        b_, loga = np.polyfit(xs, ys, 1, w=ws)
        out["power_law_mean"] = {"form": "mean|d| = a * (1 + s)^b, fitted to the bins' means", "a": sig(np.exp(loga)),
                                 "b": sig(b_)}
        c_, logk = np.polyfit(qs, ys, 1, w=ws)
        out["one_minus_p_law_mean"] = {"form": "mean|d| = k * (1 - p)^c, p = exp(-s), fitted to the bins' means "
                                               "(d log p / d logit = 1 - p: a near-certain token barely moves)",
                                       "k": sig(np.exp(logk)), "c": sig(c_)}
    nz = ad > 0
    if nz.sum() > 10:
        out["lognormal"] = _lognormal(np.log1p(s[nz]), np.log(ad[nz]), "log(1+s)")
        out["lognormal_one_minus_p"] = _lognormal(np.log(-np.expm1(-np.maximum(s[nz], 1e-12))), np.log(ad[nz]),
                                                  "log(1-p)")
    return out


def _lognormal(x: np.ndarray, y: np.ndarray, name: str) -> dict:
    """log|d| ~ N(mu0 + mu1 x, sigma): least squares, and the residual spread."""
    mu1, mu0 = np.polyfit(x, y, 1)
    resid = y - (mu0 + mu1 * x)
    return {"form": f"log|d| ~ N(mu0 + mu1*{name}, sigma) for d != 0; P(d == 0) = zero_frac", "mu0": sig(mu0),
            "mu1": sig(mu1), "sigma": sig(resid.std())}


def tail_fit(ad: np.ndarray, cu: np.ndarray) -> dict:
    """(b): tail-token rates, and how a sequence's max |d| grows with its length."""
    out = {f"frac_gt_{lvl:g}": sig(np.mean(ad > lvl), 3) for lvl in TAIL_LEVELS}
    out.update({f"count_gt_{lvl:g}": int(np.sum(ad > lvl)) for lvl in TAIL_LEVELS})
    lens = np.diff(cu)
    keep = lens > 0
    starts = cu[:-1][keep]
    seq_max = np.maximum.reduceat(ad, starts) if len(ad) else np.array([])
    lens = lens[keep]
    out["seq_max_catastrophic_frac"] = sig(np.mean(seq_max >= CATASTROPHIC), 3)
    edges = np.unique(np.quantile(lens, np.linspace(0, 1, 6)))
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = (lens >= lo) & ((lens < hi) if hi < edges[-1] else (lens <= hi))
        if sel.any():
            rows.append({"len_lo": int(lo), "len_hi": int(hi), "count": int(sel.sum()),
                         "seq_max_mean": sig(seq_max[sel].mean()), "seq_max_p90": sig(np.quantile(seq_max[sel], 0.9)),
                         "frac_max_ge_2": sig(np.mean(seq_max[sel] >= CATASTROPHIC), 3)})
    out["seq_max_by_length"] = rows
    out["prefix_max"] = prefix_max(ad, starts, lens)
    ok = seq_max > 0
    if ok.sum() > 5 and len(np.unique(lens[ok])) > 1:
        e, logc = np.polyfit(np.log(lens[ok]), np.log(seq_max[ok]), 1)
        out["seq_max_power_law"] = {"form": "seq max|d| ~ c * L^e (log-log least squares)", "c": sig(np.exp(logc)),
                                    "e": sig(e)}
    return out


def prefix_max(ad: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> list[dict]:
    """Max |d| over the first L tokens of each sequence at least L long, L = 4, 8, ..., the longest:
    how the sequence max grows with length inside the same sequences (no selection by length)."""
    rows, width = [], 4
    while width <= lens.max(initial=0):
        sel = lens >= width
        m = np.array([ad[a : a + width].max() for a in starts[sel]])
        rows.append({"len": int(width), "seqs": int(sel.sum()), "mean": sig(m.mean()), "p90": sig(np.quantile(m, 0.9)),
                     "frac_ge_2": sig(np.mean(m >= CATASTROPHIC), 3)})
        width *= 2
    return rows


def autocorr(x: np.ndarray, lags: int = LAGS) -> list[float]:
    x = x - x.mean()
    den = float(np.dot(x, x))
    return [sig(np.dot(x[:-k], x[k:]) / den, 3) if den > 0 and len(x) > k else None for k in range(1, lags + 1)]


def per_step(data: dict, d: np.ndarray, lr: np.ndarray, tok_mask: np.ndarray) -> dict:
    """(c), (d), (e): the step series of the anchors, their spread, autocorrelation and growth."""
    cu, steps, scu = data["cu_seqlens"], data["steps"], data["step_seq_cu"]
    rows = []
    for j, step in enumerate(steps):
        lo, hi = cu[scu[j]], cu[scu[j + 1]]
        m = tok_mask[lo:hi]
        dd, rr = d[lo:hi][m], lr[lo:hi][m]
        ad = np.abs(dd)
        seq_cu = cu[scu[j] : scu[j + 1] + 1] - lo
        seq_max = [np.abs(d[lo + a : lo + b][tok_mask[lo + a : lo + b]]).max(initial=0.0)
                   for a, b in zip(seq_cu[:-1], seq_cu[1:], strict=True)]
        rows.append({"step": int(step), "mean_abs_d": ad.mean(), "mult_prob_error": np.exp(ad).mean(),
                     "probs_diff": np.abs(np.exp(rr + dd) - np.exp(rr)).mean(),
                     "seq_catastrophic_frac": float(np.mean(np.array(seq_max) >= CATASTROPHIC)),
                     "max_abs_d": ad.max(initial=0.0)})
    x = np.array([r["step"] for r in rows], float)
    y = np.array([r["mean_abs_d"] for r in rows])
    out: dict = {"num_steps": len(rows)}
    for key in ("mean_abs_d", "mult_prob_error", "probs_diff", "seq_catastrophic_frac", "max_abs_d"):
        v = np.array([r[key] for r in rows])
        out[key] = {"median": sig(np.median(v)), "max": sig(v.max()), "min": sig(v.min())}
    out["mean_abs_d"]["cv"] = sig(y.std() / y.mean(), 3)
    if len(rows) >= 8:
        slope, icept = np.polyfit(x, np.log(y), 1)
        resid = np.log(y) - (slope * x + icept)
        out["mean_abs_d"]["cv_detrended"] = sig(np.std(resid), 3)
        out["mean_abs_d"]["autocorr_detrended_log"] = autocorr(resid)
        out["mean_abs_d"]["autocorr_raw"] = autocorr(y)
        k = max(1, len(y) // 10)
        out["growth"] = {"slope_log_per_step": sig(slope, 3), "factor_per_100_steps": sig(np.exp(100 * slope), 3),
                         "first_tenth_mean": sig(y[:k].mean()), "last_tenth_mean": sig(y[-k:].mean())}
    out["series_mean_abs_d"] = [sig(v, 3) for v in y]
    return out


def fit_run(run_dir: Path, series: bool = False) -> dict:
    data = load(run_dir)
    mask = data["mask"].astype(bool)
    lr, lt = data["logp_rollout"].astype(np.float64), data["logp_train"].astype(np.float64)
    d = lt - lr
    dm, sm = d[mask], -lr[mask]
    cu_masked = np.concatenate([[0], np.cumsum(np.add.reduceat(mask, data["cu_seqlens"][:-1]))]) \
        if len(mask) else np.zeros(1, int)
    lens = np.diff(data["cu_seqlens"])
    rewards = [x["reward_mean"] for x in data["loop"] if "reward_mean" in x]
    k = min(20, max(1, len(rewards) // 2))
    args = data["summary"].get("args", {})
    out = {
        "run": run_dir.name,
        "config": {key: args.get(key) for key in ("arch", "random", "engine_dtype", "trainer_dtype", "trainer",
                                                  "prompts", "group", "max_tokens", "ignore_eos", "lr")},
        "model": data["summary"].get("model"),
        "tokens": token_fit(dm, sm),
        "tails": tail_fit(np.abs(dm), cu_masked.astype(np.int64)),
        "steps": per_step(data, d, lr, mask),
        "reward": {"first": sig(np.mean(rewards[:k]), 3), "last": sig(np.mean(rewards[-k:]), 3), "edge_steps": k,
                   "min": sig(min(rewards), 3), "max": sig(max(rewards), 3)},
        "response_len": {"mean": sig(lens.mean()), "p10": int(np.quantile(lens, 0.1)), "p50": int(np.median(lens)),
                         "p90": int(np.quantile(lens, 0.9)), "max": int(lens.max()), "min": int(lens.min()),
                         "num_seqs": int(len(lens))},
        "monitor": {key: data["summary"].get(key) for key in ("halted", "steps_with_warn_or_worse", "alarms_by_kind",
                                                              "wall_s", "median_step_s")},
    }
    if series:
        out["series"] = {"reward": [sig(r, 3) for r in rewards], "mean_abs_d": out["steps"]["series_mean_abs_d"]}
    del out["steps"]["series_mean_abs_d"]
    return out


def compact_json(obj) -> str:
    """Indented JSON with every list of numbers and every flat object on one line (a few KB a run)."""
    import re

    text = json.dumps(obj, indent=1)
    text = re.sub(r"\{\n\s*([^{}\[\]]*?)\n\s*\}", lambda m: "{" + " ".join(m.group(1).split()) + "}", text)
    return re.sub(r"\[\s*([-0-9.e, \n]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories with tokens.npz")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--series", action="store_true", help="also write each run's reward and mean |d| per step")
    args = ap.parse_args(argv)
    fits = {"about": "benchmarks/field_fit.py over healthy real-loop runs (benchmarks/bench_real_loop.py --record); "
                     "d = logp_train - logp_rollout, s = -logp_rollout",
            "runs": [fit_run(r, args.series) for r in args.runs if (r / "tokens.npz").is_file()]}
    text = compact_json(fits)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for f in fits["runs"]:
        t, st = f["tokens"], f["steps"]
        print(f"{f['run']}: {t['num_tokens']} tokens, |d| p50 {t['abs_d']['p50']:.2e} p99 {t['abs_d']['p99']:.2e} "
              f"max {t['abs_d']['max']:.2f}; step mean|d| median {st['mean_abs_d']['median']:.2e}; "
              f"reward {f['reward']['first']} -> {f['reward']['last']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
