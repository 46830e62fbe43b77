"""Everything the report shows, collected from one `Run`.

`collect(run)` opens the run once and hands it to the summary (`rlcheck.report.summary`) and the
verdict (`rlcheck.forensics.diagnose`); the Run reads each file once (metrics.jsonl, state.json, the
dumps, loop.jsonl, the engine guard's record) however many of them ask. It also rebuilds the
periodic detector's periodogram, and takes an MoE run's routing agreement (`rlcheck/moe/*`) from the
records it already has. Nothing here draws.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core import histogram as H
from rlcheck.core import metrics as K
from rlcheck.core.detect.periodic import PeriodicConfig
from rlcheck.core.run import DumpInfo, Run
from rlcheck.core.stats import StatsConfig
from rlcheck.report.periodogram import Periodogram, periodogram, watched_metrics

REWARD = "loop/reward_mean"
MAX_OFFENDERS = 20
"""Rows of the run-wide offenders table."""


@dataclass(frozen=True)
class Panel:
    """One small time-series plot: its title and the metric keys drawn on it (the first carries the
    alarm markers)."""

    title: str
    keys: tuple[str, ...]


_STATS = StatsConfig()  # the default levels, named in the panel titles
PANELS = (
    # the clipped mean first (it carries the markers): the level the rolling detectors and the gate watch
    Panel(f"mean |d| (nats): clipped at {_STATS.clip:g}, raw", (K.ABS_DIFF_CLIPPED_MEAN, K.ABS_DIFF_MEAN)),
    Panel("max |d| (nats)", (K.ABS_DIFF_MAX,)),
    Panel(f"catastrophic tokens (fraction, |d| >= {_STATS.catastrophic_tau:g})", (K.CATASTROPHIC_TOKEN_FRAC,)),
    Panel("importance ratio", (K.RATIO_MAX, K.RATIO_MIN)),
    Panel("KL k3 (train vs rollout)", (K.KL_K3,)),
    Panel("catastrophic sequences (fraction)", (K.SEQ_CATASTROPHIC_FRAC,)),
    Panel("reward (loop)", (REWARD,)),
)
MOE_PANELS = (
    Panel("tokens routed to the same experts at every MoE layer (fraction)", (K.MOE_ROUTE_AGREE_FRAC,)),
    Panel("share of sum |d| on the tokens routed differently", (K.MOE_ABS_DIFF_SHARE,)),
)
"""The MoE routing section's line plots (a run whose batches carried `StepBatch.routing`)."""
TURN_PANELS = (
    Panel("turns >= 1 over turn 0 (clipped mean |d|, ratio)", (K.TURN_LATER_RATIO,)),
    Panel("the turns' first tokens over the rest (ratio)", (K.TURN_HEAD_BODY_RATIO,)),
)
"""The Turns section's line plots (a run whose batches carried `StepBatch.turns`; `rlcheck.report.turns`)."""


def turn_keys(records: list[dict[str, Any]]) -> set[str]:
    """The `rlcheck/turn/*` series the Turns section draws, when some record logged turns (else none)."""
    if not any(K.TURN_COUNT in (r.get("metrics") or {}) for r in records):
        return set()
    slots = (*(str(t) for t in range(K.TURN_MAX_INDEX + 1)), "last")
    return ({K.turn_metric(s, stat) for s in slots for stat in ("abs_diff_clipped_mean", "tokens")}
            | {p.keys[0] for p in TURN_PANELS} | {K.TURN_PER_SEQ_MEAN} | {K.TURN_MASKED_TOKENS}
            | {K.turn_invariant(n) for n in K.TURN_INVARIANTS})


@dataclass
class RunData:
    run_dir: Path
    summary: dict[str, Any]
    """`rlcheck.report.summary.summarize(run_dir)`."""
    diagnosis: Any
    """`rlcheck.forensics.diagnose.Diagnosis` of the run."""
    steps: np.ndarray
    """(S,) int64, ascending."""
    series: dict[str, np.ndarray]
    """metric key -> (S,) float64, NaN where the step did not log it: the panels' metrics and those the
    periodic detector watched, each if some step logged it."""
    alarms: list[dict[str, Any]]
    """Every alarm of the run, in step order."""
    hist_run: dict[str, list[int]]
    """The |d| histogram summed over the run, sparse like a record's `abs_diff_hist`."""
    worst_step: int | None
    """The step with the largest mean |d|."""
    hist_worst: dict[str, list[int]] | None
    offenders: list[dict[str, Any]]
    """The run's worst logged offenders (max |d| first), each with its "step"."""
    worst_offenders: list[dict[str, Any]]
    """The offenders of `worst_step`."""
    dumps: list[DumpInfo]
    context: dict[str, Any]
    """The newest dump's context (model, engine, sampling, trainer, fault); {} without a dump."""
    loop: list[dict[str, Any]] = field(default_factory=list)
    """loop.jsonl lines (reward, loss, sync_skipped, seconds per phase); [] without one."""
    periodograms: list[Periodogram] = field(default_factory=list)
    guard: Any = None
    """The engine guard's output (`rlcheck.core.run.guard_files.GuardData`: summary, violations, break
    snapshots); None when the run has no run_dir/guard."""
    localizations: list[dict[str, Any]] = field(default_factory=list)
    """The localize.json of each dump `rlcheck localize` has run on (`rlcheck.forensics.localize.compare`)."""
    moe_layers: int = 0
    """MoE layers whose routing agreement the records carry (`rlcheck/moe/*`, in `series`); 0: none."""


def collect(run: Run | str | Path) -> RunData:
    """Read the run (a `Run`, or its directory, opened once): an InputError when it is missing or
    holds no metrics.jsonl records."""
    from rlcheck.forensics.diagnose import diagnose
    from rlcheck.forensics.diagnose.localized import load_localizations
    from rlcheck.report.summary import summarize

    run = Run.open(run)
    raw = run.records()  # raises InputError without metrics.jsonl or records
    localizations = load_localizations(run.whole_dumps())  # read once, for the verdict and the section
    summary, diagnosis = summarize(run), diagnose(run, localizations)
    records = sorted(raw, key=lambda r: int(r["step"]))
    steps = np.array([int(r["step"]) for r in records], dtype=np.int64)
    watched = watched_metrics(run.state(), PeriodicConfig())
    moe = moe_layer_count(records)
    series = _series(records, {k for p in PANELS for k in p.keys} | set(watched) | set(moe_keys(moe))
                     | turn_keys(records))
    alarms = [a for r in records for a in r.get("alarms") or ()]
    worst = _worst_record(records)
    return RunData(
        run_dir=run.path, summary=summary, diagnosis=diagnosis, steps=steps, series=series,
        alarms=alarms, hist_run=_sum_hists(records), worst_step=None if worst is None else int(worst["step"]),
        hist_worst=None if worst is None else worst.get("abs_diff_hist"),
        offenders=_worst_offenders(records), worst_offenders=list((worst or {}).get("offenders") or ()),
        dumps=run.dumps(), context=run.context(), loop=run.loop(),
        periodograms=_periodograms(watched, steps, series, alarms), guard=run.guard(), localizations=localizations,
        moe_layers=moe,
    )


def moe_layer_count(records: list[dict[str, Any]]) -> int:
    """The MoE layers whose routing agreement some record logged (`rlcheck.core.moe`); 0 without routing."""
    count = 0
    for r in records:
        metrics = r.get("metrics") or {}
        while K.moe_layer_agree(count) in metrics:
            count += 1
    return count


def moe_keys(num_layers: int) -> tuple[str, ...]:
    """The `rlcheck/moe/*` series the report draws for `num_layers` MoE layers (none for 0)."""
    if not num_layers:
        return ()
    per_layer = [key(i) for i in range(num_layers) for key in (K.moe_layer_agree, K.moe_first_diff)]
    return (*(k for p in MOE_PANELS for k in p.keys), *per_layer)


def _series(records: list[dict[str, Any]], keys: set[str]) -> dict[str, np.ndarray]:
    out = {k: np.full(len(records), np.nan) for k in keys}
    for i, r in enumerate(records):
        metrics = r.get("metrics") or {}
        for k in keys:
            v = metrics.get(k)
            if isinstance(v, (int, float)):
                out[k][i] = v
    return {k: v for k, v in out.items() if not np.isnan(v).all()}


def _periodograms(watched: tuple[str, ...], steps: np.ndarray, series: dict[str, np.ndarray],
                  alarms: list[dict[str, Any]]) -> list[Periodogram]:
    """One per metric the periodic detector watched (and the run logged), where it had warmed up."""
    out = []
    for metric in watched:
        pg = periodogram(steps, series[metric], metric, alarms) if metric in series else None
        if pg is not None:
            out.append(pg)
    return out


def _worst_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    scored = [(v, r) for r in records if isinstance(v := (r.get("metrics") or {}).get(K.ABS_DIFF_MEAN), (int, float))
              and np.isfinite(v)]
    return max(scored, key=lambda t: t[0])[1] if scored else None


def _sum_hists(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    total = np.zeros(H.NUM_ABS_BINS, dtype=np.int64)
    for r in records:
        hist = r.get("abs_diff_hist") or {}
        if hist.get("bins"):
            np.add.at(total, np.asarray(hist["bins"], dtype=np.int64), np.asarray(hist["counts"], dtype=np.int64))
    bins = np.flatnonzero(total)
    return {"bins": bins.tolist(), "counts": total[bins].tolist()}


def _worst_offenders(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def score(o: dict[str, Any]) -> float:
        v = o.get("max_abs_diff")
        return float("inf") if o.get("nonfinite") else (v if isinstance(v, (int, float)) and v == v else -1.0)

    rows = ({**o, "step": int(r["step"])} for r in records for o in r.get("offenders") or () if isinstance(o, dict))
    return heapq.nlargest(MAX_OFFENDERS, rows, key=score)
