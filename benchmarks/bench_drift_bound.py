"""How fast any detector without a probe can see the field streams' fast drift (issue 37 item 5): an oracle
bound on the step-level series alone.

    .venv/bin/python benchmarks/bench_drift_bound.py                  # the table in BENCHMARKS.md
    .venv/bin/python benchmarks/bench_drift_bound.py --healthy-runs 50 --drift-runs 500
    .venv/bin/python benchmarks/bench_drift_bound.py --drift 1 --window 400   # the slow drift: the factor at the alarm

The field streams' step level is an AR(1) process in log space (`FieldConfig.level_ar` 0.7, stationary std
`level_sigma` 0.15, Student-t 5 innovations): the wobble of what the policy samples, which scales the
residual level as it scales the mean |d|. The fast drift (`rlcheck.synthetic.power.DRIFTS[0]`) multiplies
the engine's mismatch by 3.3 ** (k / 30) k steps after its onset. The oracle knows everything but the
onset: the AR coefficient and the innovations' scale (it whitens the series exactly), the ramp's slope and
shape, and the healthy level (zero in log: no reference to estimate, no floor growth). Its statistic is the
Gaussian generalized likelihood ratio of "a ramp began at tau" over tau in the last `--window` steps:

    e_t = y_t - phi y_(t-1)                          (the innovations, std s)
    m_j = slope (j + 1) - phi slope j   (m_0 = slope)  (the ramp's mean in the innovations, j steps in)
    GLR_t = max_tau sum_j (m_j e_(tau+j) - m_j^2 / 2) / s^2

Its threshold is the largest GLR seen on `--healthy-runs` healthy series of `--steps` steps (no false alarm
there); the table gives the steps from the onset to the first GLR past it, and, for a threshold low enough to
catch the drift within 10 steps in half of the runs, how many false alarms the healthy series then raise. A
real detector estimates what the oracle is given (the reference level, the AR structure, the slope) and
faces the healthy floor's growth besides: it can only be slower at the same false alarms.
"""

from __future__ import annotations

import argparse

import numpy as np

from rlcheck.synthetic.field import FieldConfig
from rlcheck.synthetic.power import DRIFTS

NU = 5
"""Student-t degrees of freedom of the level's innovations (`rlcheck.synthetic.field`)."""


def ar1(n: int, phi: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """(n,) an AR(1) series with stationary std `sigma`, Student-t innovations scaled to unit variance."""
    e = rng.standard_t(NU, n) * np.sqrt((NU - 2) / NU) * sigma * np.sqrt(1 - phi**2)
    y = np.empty(n)
    y[0] = rng.standard_t(NU) * np.sqrt((NU - 2) / NU) * sigma
    for i in range(1, n):
        y[i] = phi * y[i - 1] + e[i]
    return y


def glr(y: np.ndarray, phi: float, sigma: float, slope: float, window: int) -> np.ndarray:
    """(n - 1,) GLR_t of a ramp of `slope` per step begun within the last `window` steps (innovation t = y[t+1])."""
    s2 = sigma**2 * (1 - phi**2)
    e = y[1:] - phi * y[:-1]
    best = np.full(e.size, -np.inf)
    for lag in range(window + 1):
        j = np.arange(lag + 1)
        m = slope * (j + 1) - phi * slope * j  # (lag + 1,)
        stat = (np.correlate(e, m, mode="valid") - 0.5 * m @ m) / s2  # ends at t = lag .. n - 2
        best[lag:] = np.maximum(best[lag:], stat)
    return best


def delays(thr: float, runs: int, phi: float, sigma: float, value: float, ramp: int, window: int,
           rng: np.random.Generator, before: int = 300, after: int = 120) -> np.ndarray:
    """(runs,) steps from the drift's onset to the first GLR past `thr` (`after` where none; alarms before
    the onset are false ones on the drift stream and not counted)."""
    slope = np.log(value) / ramp
    out = np.empty(runs, dtype=int)
    for r in range(runs):
        y = ar1(before + after, phi, sigma, rng)
        y[before:] += slope * np.minimum(np.arange(after), ramp)
        g = glr(y, phi, sigma, slope, window)[before - 1:]  # g[k]: innovation at y[before + k]
        hit = np.flatnonzero(g > thr)
        out[r] = hit[0] if hit.size else after
    return out


def main() -> None:
    global NU
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--healthy-runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2000, help="steps of each healthy series")
    ap.add_argument("--drift-runs", type=int, default=100)
    ap.add_argument("--window", type=int, default=40, help="onsets searched, steps back")
    ap.add_argument("--drift", type=int, default=0, choices=range(len(DRIFTS)),
                    help="which of `DRIFTS`: 0 the 3.3x rise over 30 steps, 1 the 5x rise over 450")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nu", type=float, default=NU, help="the innovations' Student-t degrees of freedom (1000: ~Gaussian)")
    args = ap.parse_args()
    NU = args.nu
    field, fault = FieldConfig(), DRIFTS[args.drift].fault
    after = max(120, fault.ramp + 50)
    phi, sigma, slope = field.level_ar, field.level_sigma, np.log(fault.value) / fault.ramp
    rng = np.random.default_rng(args.seed)
    healthy = [glr(ar1(args.steps, phi, sigma, rng), phi, sigma, slope, args.window) for _ in range(args.healthy_runs)]
    thr = max(float(g.max()) for g in healthy)
    d = delays(thr, args.drift_runs, phi, sigma, fault.value, fault.ramp, args.window, rng, after=after)
    q = np.percentile(d, [10, 50, 90])
    total = args.healthy_runs * args.steps
    print(f"AR(1) phi {phi}, stationary std {sigma}, t{NU:g} innovations; drift {fault.value}x over {fault.ramp} steps")
    print(f"no false alarm in {args.healthy_runs} x {args.steps} healthy steps: threshold {thr:.2f}; steps to the alarm "
          f"p10 {q[0]:.0f}, median {q[1]:.0f}, p90 {q[2]:.0f}; within 10 steps in {np.mean(d <= 10):.0%} of "
          f"{args.drift_runs} runs; factor at the alarm p10 {fault.engine_factor(fault.onset + q[0]):.2f}x, median "
          f"{fault.engine_factor(fault.onset + q[1]):.2f}x, p90 {fault.engine_factor(fault.onset + q[2]):.2f}x")
    for low in np.arange(thr, 0, -0.5) if args.drift == 0 else ():  # the 10-step target is the fast drift's
        d10 = delays(low, args.drift_runs, phi, sigma, fault.value, fault.ramp, args.window, rng, after=after)
        if np.median(d10) <= 10:
            false = sum(int(np.count_nonzero((g[1:] > low) & (g[:-1] <= low))) for g in healthy)
            print(f"median alarm within 10 steps at threshold {low:.2f}: steps to the alarm p10 "
                  f"{np.percentile(d10, 10):.0f}, median {np.median(d10):.0f}; the healthy series then cross it "
                  f"{false} times ({1000 * false / total:.2f} per 1,000 healthy steps, "
                  f"{sum(bool((g > low).any()) for g in healthy)} of {args.healthy_runs} series)")
            break


if __name__ == "__main__":
    main()
