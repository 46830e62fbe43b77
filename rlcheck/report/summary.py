"""`rlcheck summarize RUN_DIR`: what a run's metrics.jsonl says, at a glance.

`summarize(run)` (a `Run`, or a run directory) returns a plain dict (steps, alarms grouped by kind and metric, the worst steps,
metric ranges, dumps); `render(summary, console)` prints it as rich tables.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.run import Run

RANGE_KEYS = (
    K.ABS_DIFF_MEAN, K.ABS_DIFF_P99, K.ABS_DIFF_MAX, K.KL_K3, K.MULT_PROB_ERROR, K.PROB_ABS_DIFF_MEAN,
    K.RATIO_MAX, K.SEQ_FLAGGED_FRAC, K.SEQ_CATASTROPHIC_COUNT,
)


def summarize(run: Run | str | os.PathLike[str], worst: int = 5) -> dict[str, Any]:
    """The summary of a run (a `Run`, or its directory, opened once); InputError without records."""
    run = Run.open(run)
    records = run.records()
    steps = [int(r["step"]) for r in records]
    alarms: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        for a in r.get("alarms", []):
            key = (a["kind"], a["metric"], a["severity"])
            g = alarms.setdefault(key, {"kind": a["kind"], "metric": a["metric"], "severity": a["severity"],
                                        "count": 0, "first_step": a["step"], "last_step": a["step"],
                                        "message": a["message"]})
            g["count"] += 1
            g["last_step"] = a["step"]
            g["message"] = a["message"]
    ranges = {}
    for key in RANGE_KEYS:
        vals = np.array([r["metrics"][key] for r in records if isinstance(r["metrics"].get(key), (int, float))])
        if vals.size:
            ranges[key] = {"min": float(vals.min()), "median": float(np.median(vals)), "max": float(vals.max())}
    scored = [(r["metrics"].get(K.ABS_DIFF_MEAN, 0.0), int(r["step"]), r) for r in records]
    scored.sort(key=lambda t: -t[0] if isinstance(t[0], (int, float)) else 0.0)
    worst_steps = [
        {"step": s, "abs_diff_mean": v, "alarms": len(r.get("alarms", [])),
         "top_offender": (r.get("offenders") or [{}])[0].get("request_id")}
        for v, s, r in scored[:worst]
    ]
    dumps = [str(p) for p in run.dump_paths()]
    return {
        "run_dir": str(run.path),
        "num_steps": len(records),
        "first_step": min(steps),
        "last_step": max(steps),
        "skipped_lines": records.num_skipped,
        "superseded_steps": list(records.superseded),
        "alarms": sorted(alarms.values(), key=lambda g: (-["info", "warn", "critical"].index(g["severity"]), g["first_step"])),
        "worst_steps": worst_steps,
        "ranges": ranges,
        "dumps": dumps,
    }


def render(summary: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    s = summary
    console.print(
        f"[bold]{s['run_dir']}[/]: {s['num_steps']} steps ({s['first_step']}..{s['last_step']})"
        + (f", {s['skipped_lines']} unreadable lines skipped" if s["skipped_lines"] else "")
        + (f", {len(s['superseded_steps'])} steps journaled again by a resumed trainer (the later records "
           "count)" if s.get("superseded_steps") else "")
    )
    if s["alarms"]:
        t = Table(title="alarms", title_justify="left")
        for col in ("severity", "kind", "metric", "count", "steps"):
            t.add_column(col)
        for g in s["alarms"]:
            style = {"critical": "bold red", "warn": "yellow"}.get(g["severity"], "dim")
            t.add_row(f"[{style}]{g['severity']}[/]", g["kind"], g["metric"].removeprefix(K.PREFIX),
                      str(g["count"]), f"{g['first_step']}..{g['last_step']}")
        console.print(t)
        for g in s["alarms"]:
            console.print(f"  last {g['kind']} on {g['metric'].removeprefix(K.PREFIX)}: ", g["message"], markup=False)
    else:
        console.print("[green]no alarms[/]")
    t = Table(title="worst steps by mean |d|", title_justify="left")
    for col in ("step", "mean |d|", "alarms", "top offender"):
        t.add_column(col)
    for w in s["worst_steps"]:
        t.add_row(str(w["step"]), f"{w['abs_diff_mean']:.4g}", str(w["alarms"]), str(w["top_offender"]))
    console.print(t)
    t = Table(title="metric ranges", title_justify="left")
    for col in ("metric", "min", "median", "max"):
        t.add_column(col)
    for key, r in s["ranges"].items():
        t.add_row(key.removeprefix(K.PREFIX), f"{r['min']:.4g}", f"{r['median']:.4g}", f"{r['max']:.4g}")
    console.print(t)
    for d in s["dumps"]:
        console.print(f"dump: {d}")
