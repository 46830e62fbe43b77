"""The report's plots: matplotlib figures rendered to SVG strings that go inline into the page.

No pyplot (no global figure state), no files. Text stays text (`svg.fonttype: none`, small files),
the XML header and metadata are dropped, and each figure's ids are salted with its own name so that
several SVGs share one page without clashing. Hover text: an artist drawn with `gid=...` becomes
`<g id="...">` in the SVG, and `to_svg` puts an SVG `<title>` (escaped) first inside it.

Captions and every piece of user text (metric names, messages, request ids) stay in the HTML, never
in matplotlib (which would read `$...$` as math). Long series are thinned to `MAX_POINTS` by keeping
each bucket's min and max (spikes survive); alarm markers sit at their exact steps and values.
"""

from __future__ import annotations

import functools
import html
import io
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlcheck.core.types import severity_rank
from rlcheck.report.data import Panel
from rlcheck.report.periodogram import Periodogram

SEVERITY_COLORS = {"critical": "#d62728", "warn": "#ff7f0e", "info": "#1f77b4"}
LINE_COLORS = ("#333333", "#17becf")
MAX_POINTS = 2000
"""Points drawn per line; longer series keep each bucket's min and max."""
MAX_TIPS = 300
"""Alarm steps per plot with their own hover text (vector markers); the rest are drawn as one raster."""
MAX_TIP_LINES = 8
HIST_GROUP = 4
"""|d| histogram bins (16 per octave) merged into one bar: 4 bars per octave."""
MAX_MARKS = 2000
"""Vertical marks (skipped syncs) drawn per plot at most."""
MAX_COLUMNS = 400
"""Steps of a per-layer heat map; more are merged (each bucket keeps its lowest value)."""
_STYLE = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 8, "axes.spines.top": False,
          "axes.spines.right": False, "font.family": "sans-serif"}


def _styled(draw: Callable[..., str]) -> Callable[..., str]:
    """Runs `draw` under the report's matplotlib style (text made later takes rcParams at creation)."""

    @functools.wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> str:
        from matplotlib import rc_context

        with rc_context(_STYLE):
            return draw(*args, **kwargs)

    return wrapper


def downsample(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) thinned to at most `max_points`: the min and the max of each of max_points // 2 buckets, in order."""
    if x.size <= max_points:
        return x, y
    edges = np.linspace(0, x.size, max_points // 2 + 1).astype(np.int64)
    keep = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        seg = y[lo:hi]
        if np.isnan(seg).all():
            keep.append(lo)
            continue
        keep += sorted({lo + int(np.nanargmin(seg)), lo + int(np.nanargmax(seg))})
    idx = np.asarray(keep, dtype=np.int64)
    return x[idx], y[idx]


def alarm_steps(alarms: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """(step, worst severity, hover text) per step with alarms, in step order."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for a in alarms:
        by_step.setdefault(int(a["step"]), []).append(a)
    out = []
    for step, group in sorted(by_step.items()):
        group.sort(key=lambda a: -severity_rank(a.get("severity", "info")))
        lines = [f"step {step}: {a.get('severity')} {a.get('kind')} on {a.get('metric')}: {a.get('message')}"
                 for a in group[:MAX_TIP_LINES]]
        if len(group) > MAX_TIP_LINES:
            lines.append(f"(+{len(group) - MAX_TIP_LINES} more alarms)")
        out.append((step, group[0].get("severity", "info"), "\n".join(lines)))
    return out


@_styled
def series_svg(name: str, panel: Panel, steps: np.ndarray, series: dict[str, np.ndarray],
               alarms: list[tuple[int, str, str]], marks: Sequence[int] = ()) -> str:
    """One panel: its metrics over the steps, the alarm steps marked on the first, `marks` as grey lines."""
    fig, ax = _figure(4.0, 1.9)
    keys = [k for k in panel.keys if k in series]
    for color, key in zip(LINE_COLORS, keys, strict=False):
        ax.plot(*downsample(steps, series[key]), color=color, lw=0.9)
    first = series[keys[0]]
    finite = first[np.isfinite(first)]
    if finite.size and finite.min() > 0 and finite.max() > 100 * finite.min():
        ax.set_yscale("log")
    elif finite.size and finite.min() == 0:  # a count or a fraction that is mostly 0
        ax.set_ylim(bottom=0)
    if 0 < len(marks) <= MAX_MARKS:
        ax.vlines(marks, 0, 1, transform=ax.get_xaxis_transform(), color="#cccccc", lw=0.7, zorder=0)
    tips = _alarm_markers(ax, name, steps, first, alarms)
    ax.set_xlabel("step")
    return to_svg(fig, name, tips)


def _alarm_markers(ax: Any, name: str, steps: np.ndarray, values: np.ndarray,
                   alarms: list[tuple[int, str, str]]) -> dict[str, str]:
    """Marks each alarm step on the curve (at its exact value); returns gid -> hover text."""
    pos = np.searchsorted(steps, [s for s, _, _ in alarms])
    tips, rest = {}, []
    for i, ((step, severity, text), p) in enumerate(zip(alarms, pos.tolist(), strict=True)):
        if p >= steps.size or steps[p] != step or not np.isfinite(values[p]):
            continue
        color = SEVERITY_COLORS.get(severity, "#1f77b4")
        if len(tips) < MAX_TIPS:
            gid = f"{name}-alarm-{i}"
            ax.plot([step], [values[p]], "o", ms=4.5, color=color, mec="white", mew=0.5, zorder=3, gid=gid)
            tips[gid] = text
        else:
            rest.append((step, values[p], color))
    if rest:  # one raster image inside the SVG: exact positions, a size that does not grow with the count
        x, y, c = zip(*rest, strict=True)
        ax.scatter(x, y, s=12, c=list(c), zorder=3, rasterized=True)
    return tips


@_styled
def periodogram_svg(name: str, pg: Periodogram) -> str:
    """Bars of the fold score per period, the decision level, and the detected period in red."""
    fig, ax = _figure(6.0, 2.3)
    colors = ["#d62728" if p == pg.period else "#9e9e9e" for p in pg.periods.tolist()]
    ax.bar(pg.periods, pg.scores, width=0.8, color=colors)
    ax.axhline(pg.threshold, color="#d62728", ls="--", lw=0.8)
    ax.text(0.995, pg.threshold, f"threshold {pg.threshold:g}", ha="right", va="bottom", color="#d62728",
            transform=ax.get_yaxis_transform())  # x in axes fraction, y in data
    tips = {}
    if pg.period is not None and pg.periods[0] <= pg.period <= pg.periods[-1]:
        score = float(pg.scores[pg.period - int(pg.periods[0])])
        ax.annotate(f"P = {pg.period}", (pg.period, score), xytext=(6, 4), textcoords="offset points",
                    color="#d62728", fontweight="bold", gid=f"{name}-period")
        tips[f"{name}-period"] = pg.message
    ax.set_xlabel("period P (steps)")
    ax.set_ylabel("fold score C(P)")
    ax.set_xlim(pg.periods[0] - 1, max(pg.periods[-1] + 1, pg.periods[0] + 8))
    return to_svg(fig, name, tips)


@_styled
def histogram_svg(name: str, hist_run: dict[str, Any], hist_worst: dict[str, Any] | None, worst_step: int | None) -> str:
    """The |d| histogram of the run and of its worst step, as fractions of their tokens, log-log (the
    exact-zero bin has no place on a log axis and is left out; the page gives its count)."""
    fig, ax = _figure(6.0, 2.4)
    for hist, label, style in ((hist_run, "whole run", {"fill": True, "color": "#bbbbbb"}),
                               (hist_worst, f"step {worst_step} (worst mean |d|)", {"color": "#d62728", "lw": 1.2})):
        coarse = _coarse(hist)
        if coarse is not None:
            counts, edges = coarse
            ax.stairs(counts / sum(hist["counts"]), edges, label=label, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|d| = |logp_train - logp_rollout| (nats)")
    ax.set_ylabel("fraction of tokens")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(frameon=False, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=2, borderaxespad=0.2)
    return to_svg(fig, name, {})


@_styled
def localize_svg(name: str, data: dict[str, Any]) -> str:
    """`rlcheck localize`'s per-layer plot (`rlcheck.forensics.localize.report.draw_layers`) of one
    localize.json: each request's largest relative error per decoder layer, the tolerance dashed."""
    from rlcheck.forensics.localize.report import draw_layers

    fig, ax = _figure(max(4.0, 0.5 * len(data["layer_types"]) + 2), 2.4)
    draw_layers(ax, data)
    return to_svg(fig, name, {})


@_styled
def layers_svg(name: str, steps: np.ndarray, values: np.ndarray, label: str) -> str:
    """A heat map of `values` (L, S) per layer (rows) and step (columns), e.g. each MoE layer's routing
    agreement; more than MAX_COLUMNS steps are merged into buckets that keep their lowest value. Drawn as
    one raster inside the SVG (its size does not grow with L x S)."""
    if steps.size > MAX_COLUMNS:
        starts = np.linspace(0, steps.size, MAX_COLUMNS + 1).astype(np.int64)[:-1]
        filled = np.where(np.isnan(values), np.inf, values)
        values = np.fmin.reduceat(filled, starts, axis=1)
        values[np.isinf(values)] = np.nan
        steps = steps[starts]
    edges = np.append(steps, steps[-1] + 1) if steps.size else np.zeros(1)
    fig, ax = _figure(4.0, max(1.9, 0.12 * values.shape[0] + 1.2))
    finite = values[np.isfinite(values)]
    low = float(finite.min()) if finite.size else 0.0
    mesh = ax.pcolormesh(edges, np.arange(values.shape[0] + 1), values, cmap="viridis", vmin=min(low, 0.999),
                         vmax=1.0, rasterized=True)
    fig.colorbar(mesh, ax=ax, label=label, pad=0.01)
    ax.set_xlabel("step")
    ax.set_ylabel("MoE layer")
    if values.shape[0] <= 16:
        ax.set_yticks(np.arange(values.shape[0]) + 0.5, [str(i) for i in range(values.shape[0])])
    ax.invert_yaxis()
    ax.grid(False)
    return to_svg(fig, name, {})


def _coarse(hist: dict[str, Any] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(counts, edges) of a sparse |d| histogram without its zero bin, HIST_GROUP bins to a bar."""
    from rlcheck.sinks.wandb import histogram_args

    if not hist or not hist.get("bins"):
        return None
    nonzero = [(b, c) for b, c in zip(hist["bins"], hist["counts"], strict=True) if b > 0]
    args = histogram_args({"bins": [b for b, _ in nonzero], "counts": [c for _, c in nonzero]})
    if args is None:
        return None
    counts, edges = args
    starts = np.arange(0, counts.size, HIST_GROUP)
    return np.add.reduceat(counts, starts), np.append(edges[starts], edges[-1])


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    ax.tick_params(labelsize=7)
    ax.grid(True, color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)
    return fig, ax


def to_svg(fig: Any, name: str, tips: dict[str, str]) -> str:
    """The figure as an inline `<svg>` element, with `tips` (gid -> text) as hover titles."""
    from matplotlib import rc_context

    buf = io.StringIO()
    with rc_context({"svg.hashsalt": f"rlcheck-report-{name}"}):
        fig.savefig(buf, format="svg", dpi=150, metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    for gid, text in tips.items():
        tag = f'<g id="{gid}">'
        svg = svg.replace(tag, f"{tag}<title>{html.escape(text)}</title>", 1)
    return svg
