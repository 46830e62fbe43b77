"""The report's multi-turn section (a run whose batches carried `StepBatch.turns`): which turn diverges.

A per-turn plot (the clipped mean |d| of turn 0..7 and the last turn: the median over the run's steps
and over its alarmed steps), a heat map of the same per turn and step, the later-turn and head/body
ratios over the steps with their alarms, and the cross-turn invariants the run broke, counted. Nothing
for a run without turns.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.report.data import TURN_PANELS

LEVEL = "abs_diff_clipped_mean"


def per_turn_svg(name: str, labels: list[str], overall: np.ndarray, alarmed: np.ndarray | None) -> str:
    """Clipped mean |d| per turn: the median over every step, and over the alarmed steps."""
    from rlcheck.report.plots import _figure, to_svg

    fig, ax = _figure(4.0, 2.2)
    x = np.arange(len(labels))
    ax.plot(x, overall, "o-", color="#333333", label="every step (median)")
    if alarmed is not None and np.isfinite(alarmed).any():
        ax.plot(x, alarmed, "s-", color="#d62728", label="alarmed steps (median)")
    ax.set_xticks(x, labels)
    ax.set_xlabel("turn")
    ax.set_ylabel("clipped mean |d| (nats)")
    if np.nanmax(np.concatenate([overall, alarmed if alarmed is not None else overall])) > 0:
        ax.set_yscale("log")
    ax.legend(frameon=False, fontsize=7)
    return to_svg(fig, name, {})


def heat_svg(name: str, steps: np.ndarray, values: np.ndarray, labels: list[str]) -> str:
    """Clipped mean |d| per turn (rows) and step (columns), log colour; long runs keep each bucket's highest."""
    from rlcheck.report.plots import MAX_COLUMNS, _figure, to_svg

    if steps.size > MAX_COLUMNS:
        starts = np.linspace(0, steps.size, MAX_COLUMNS + 1).astype(np.int64)[:-1]
        values = np.fmax.reduceat(np.where(np.isnan(values), -np.inf, values), starts, axis=1)
        values[np.isinf(values)] = np.nan
        steps = steps[starts]
    edges = np.append(steps, steps[-1] + 1) if steps.size else np.zeros(1)
    fig, ax = _figure(4.0, 2.2)
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.log10(np.where(values > 0, values, np.nan))
    mesh = ax.pcolormesh(edges, np.arange(len(labels) + 1), logged, cmap="magma", rasterized=True)
    fig.colorbar(mesh, ax=ax, label="log10 nats", pad=0.01)
    ax.set_yticks(np.arange(len(labels)) + 0.5, labels)
    ax.set_xlabel("step")
    ax.set_ylabel("turn")
    ax.invert_yaxis()
    ax.grid(False)
    return to_svg(fig, name, {})


def turn_section(data: Any, panel: Callable[..., str]) -> str:
    """The section's HTML ("" without turns); `panel(name, Panel, data, alarms, marks)` draws a series."""
    series, steps = data.series, data.steps
    if K.turn_metric("0", LEVEL) not in series:
        return ""
    slots = [s for s in (*(str(t) for t in range(K.TURN_MAX_INDEX + 1)), "last") if K.turn_metric(s, LEVEL) in series]
    nan = np.full(steps.size, np.nan)
    values = np.stack([series.get(K.turn_metric(s, LEVEL), nan) for s in slots])  # (T, S)
    alarmed = np.isin(steps, [int(a["step"]) for a in data.alarms])
    overall = _median(values)
    hot = _median(values[:, alarmed]) if alarmed.any() else None
    figs = [f"<figure class=\"plot\"><figcaption>clipped mean |d| per turn</figcaption>"
            f"{per_turn_svg('turns-level', slots, overall, hot)}</figure>",
            f"<figure class=\"plot\"><figcaption>clipped mean |d| per turn and step</figcaption>"
            f"{heat_svg('turns-heat', steps, values, slots)}</figure>"]
    figs += [panel(f"turns{i}", p, data, [a for a in data.alarms if a.get("metric") in p.keys], [])
             for i, p in enumerate(TURN_PANELS) if p.keys[0] in series]
    return (f"<h2>Turns</h2><p class=\"muted\">A multi-turn run: {_words(data, slots, overall)}</p>"
            f"{_invariants(data)}<div class=\"grid\">{''.join(figs)}</div>")


def _median(values: np.ndarray) -> np.ndarray:
    """(T,) the median of each row of `values` (T, S) over its logged steps (NaN where none)."""
    out = np.full(values.shape[0], np.nan)
    for i, row in enumerate(values):
        row = row[np.isfinite(row)]
        out[i] = np.median(row) if row.size else np.nan
    return out


def _words(data: Any, slots: list[str], overall: np.ndarray) -> str:
    per_seq = data.series.get(K.TURN_PER_SEQ_MEAN)
    parts = []
    if per_seq is not None and np.isfinite(per_seq).any():
        parts.append(f"{np.nanmedian(per_seq):.2g} model turns per sequence (median step)")
    if np.isfinite(overall).any():
        worst = int(np.nanargmax(overall))
        parts.append(f"turn {slots[worst]} the furthest off ({overall[worst]:.3g} nats, median step)")
    return html.escape("; ".join(parts) + ".")


def _invariants(data: Any) -> str:
    rows = []
    for name in K.TURN_INVARIANTS:
        v = data.series.get(K.turn_invariant(name))
        if v is not None and np.nansum(v) > 0:
            hit = data.steps[np.nan_to_num(v) > 0]
            rows.append(f"<tr><td class=\"mono\">{html.escape(name)}</td><td class=\"num\">{np.nansum(v):,.0f}</td>"
                        f"<td class=\"num\">{hit.size}</td><td class=\"num\">{int(hit[0])}</td></tr>")
    if not rows:
        return "<p>No cross-turn invariant broken.</p>"
    return ("<p>Cross-turn invariants broken (sequences over the run, steps, first step; the alarms carry the "
            "evidence):</p><table><tr><th>invariant</th><th>sequences</th><th>steps</th><th>first</th></tr>"
            f"{''.join(rows)}</table>")
