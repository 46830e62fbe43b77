"""The queries diagnose's rules share over the `Evidence`: its alarms and their steps, a metric's
series, the request ids affected at some steps (every sequence of a dump, else the logged offenders),
the catastrophic sequences of a step, and rank correlation for "rising with the step"."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core.stats import MIN_LOGPROB, StatsConfig
from rlcheck.core.stats.sequences import catastrophic_sequences
from rlcheck.forensics.diagnose.evidence import Evidence

MAX_IDS = 50
"""Request ids kept per finding."""


def alarms_of(ev: Evidence, *, kind: str | None = None, signatures: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for r in ev.records:
        for a in r.get("alarms", []):
            if (kind is None or a["kind"] == kind) and (not signatures or a["details"].get("signature") in signatures):
                out.append(a)
    return out


def alarm_steps(alarms: list[dict]) -> list[int]:
    return sorted({int(a["step"]) for a in alarms})


def metric_series(ev: Evidence, key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r["metrics"][key]) for r in ev.records if r["metrics"].get(key) is not None]
    steps, values = zip(*pairs, strict=True) if pairs else ((), ())
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)


def affected_ids(ev: Evidence, steps: list[int], min_abs_diff: float) -> list[str]:
    """Request ids at `steps` whose max |d| reaches `min_abs_diff`: every sequence where the step has a
    dump, the logged offenders (top-k) elsewhere."""
    ids: list[str] = []
    by_step = {r["step"]: r for r in ev.records}
    for s in steps:
        rows = ev.dump_rows.get(s) or by_step.get(s, {}).get("offenders", [])
        hit = sorted((row for row in rows if (row.get("max_abs_diff") or 0.0) >= min_abs_diff),
                     key=lambda row: -row["max_abs_diff"])
        ids += [row["request_id"] for row in hit if row["request_id"] not in ids]
    return ids[:MAX_IDS]


def catastrophic_rows(rows: list[dict[str, Any]], cfg: StatsConfig) -> np.ndarray:
    """(N,) bool: the dump's sequences the statistics count as catastrophic (`catastrophic_sequences`:
    a rate of their compared tokens at |d| >= catastrophic_tau), or holding a non-finite logprob
    among their compared tokens (NaN, inf or a sentinel below MIN_LOGPROB), as `rlcheck.core.stats` does."""
    lens = np.array([len(row["logp_rollout"]) for row in rows], dtype=np.int64)  # (N,)
    cu = np.concatenate([[0], np.cumsum(lens)])  # (N+1,)
    if not rows or cu[-1] == 0:
        return np.zeros(len(rows), dtype=bool)
    lr = np.concatenate([np.asarray(row["logp_rollout"], dtype=np.float64) for row in rows])  # (M,)
    lt = np.concatenate([np.asarray(row["logp_train"], dtype=np.float64) for row in rows])  # (M,)
    mask = np.concatenate([np.ones(n, dtype=bool) if row.get("mask") is None else np.asarray(row["mask"], dtype=bool)
                           for row, n in zip(rows, lens.tolist(), strict=True)])
    finite = (lr >= MIN_LOGPROB) & (lt >= MIN_LOGPROB)  # False for NaN, -inf and sentinels
    valid = mask & finite
    with np.errstate(invalid="ignore"):
        ad = np.where(valid, np.abs(lt - lr), 0.0)
    seq_of = np.repeat(np.arange(len(rows)), lens)  # (M,)
    counts = np.bincount(seq_of, weights=valid, minlength=len(rows))
    bad = np.bincount(seq_of, weights=mask & ~finite, minlength=len(rows)) > 0
    return catastrophic_sequences(ad, cu, counts, cfg) | bad


def catastrophic_ids(ev: Evidence, alarms: list[dict[str, Any]]) -> list[str]:
    """Request ids of the catastrophic sequences at the alarms' steps, worst max |d| first: exactly
    those of the step's dump, where it has one; elsewhere the logged offenders can only approximate
    (they carry no rate of tokens): the worst of them at max |d| >= catastrophic_tau (or non-finite),
    as many as the step's signature counted."""
    cfg = StatsConfig()
    count = {}
    for a in alarms:
        count[int(a["step"])] = max(count.get(int(a["step"]), 0), int(a["details"].get("count", 0)))
    by_step = {r["step"]: r for r in ev.records}
    ids: list[str] = []
    for s in sorted(count):
        if s in ev.dump_rows:
            rows = ev.dump_rows[s]
            hit = [row for row, cat in zip(rows, catastrophic_rows(rows, cfg).tolist(), strict=True) if cat]
        else:
            rows = by_step.get(s, {}).get("offenders", [])
            hit = [row for row in rows if row.get("nonfinite") or (row.get("max_abs_diff") or 0.0) >= cfg.catastrophic_tau]
            hit = sorted(hit, key=lambda row: (not row.get("nonfinite"), -(row.get("max_abs_diff") or 0.0)))[:count[s]]
        hit.sort(key=lambda row: -(row.get("max_abs_diff") or 0.0))
        ids += [row["request_id"] for row in hit if row["request_id"] not in ids]
    return ids[:MAX_IDS]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Rank correlation with ties ranked by their average (0 when either side is constant)."""
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    return float(np.corrcoef(_ranks(x), _ranks(y))[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(v.size, dtype=np.float64)
    ranks[order] = np.arange(v.size)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]


def rising(x: np.ndarray, y: np.ndarray) -> bool:
    """At least 4 points that climb with the step (rank correlation >= 0.8) to a last third at least
    1.5x the first third (medians: one noisy end point does not decide)."""
    if x.size < 4 or spearman(x, y) < 0.8:
        return False
    third = max(1, x.size // 3)
    return bool(np.median(y[-third:]) >= 1.5 * np.median(y[:third]))
