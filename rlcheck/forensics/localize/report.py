"""What `rlcheck localize` shows: the console table (`render_localization`; on an MoE, a line per request
on where its routing first differs) and the per-layer plot it saves beside localize.json
(`plot_localization`, DUMP/localize.png). Both read the result's JSON form (`LocalizeResult.to_dict()`,
or localize.json as read back), so the HTML report draws the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcheck.forensics.localize.compare import PLOT_FILE
from rlcheck.forensics.localize.routing import routing_summary, routing_words

__all__ = ["PLOT_FILE", "draw_layers", "plot_localization", "render_localization", "summary_line", "where"]

MAX_LINES = 20
"""Requests drawn in the plot (the first, i.e. the worst, ones)."""
MAX_LAYER_COLUMNS = 8
"""Models with at most this many decoder layers get one table column per layer."""
MAX_ROUTING_LINES = 10
"""Requests whose MoE routing comparison is printed (the first, i.e. the worst, ones)."""


def where(r: dict[str, Any]) -> str:
    """One request's verdict in words: "layer 2 (attention) from position 9 (response token 0, decode)"."""
    if r.get("first_divergent_layer") is None:
        return "no layer diverges"
    at = f"position {r['position']}"
    if r.get("response_position") is not None:
        at += f" (response token {r['response_position']}, {r['phase']})"
    else:
        at += f" (prompt token, {r['phase']})"
    return f"layer {r['first_divergent_layer']} ({r['layer_type']}) from {at}"


def summary_line(data: dict[str, Any]) -> str:
    """"3 of 10 requests diverge, first at layer 0 (mamba) in all 3" or "none of 10 requests diverges"."""
    reqs = data["requests"]
    bad = [r for r in reqs if r.get("first_divergent_layer") is not None]
    if not bad:
        return f"none of {len(reqs)} requests diverges at any layer (tolerance {data['tolerance']:g})"
    by_layer: dict[tuple[int, str], int] = {}
    for r in bad:
        key = (r["first_divergent_layer"], r["layer_type"])
        by_layer[key] = by_layer.get(key, 0) + 1
    parts = ", ".join(f"layer {k} ({t}) in {n}" for (k, t), n in sorted(by_layer.items(), key=lambda kv: -kv[1]))
    return f"{len(bad)} of {len(reqs)} requests diverge (tolerance {data['tolerance']:g}), first at {parts}"


def render_localization(data: dict[str, Any], console: Any) -> None:
    """Header, one row per request (its first divergent layer and position, then every layer's max
    relative error, those over the tolerance in red), and the summary."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    tol = data["tolerance"]
    console.print(f"{escape(data['path'])}: {len(data['requests'])} requests localized on {escape(data['model'])} "
                  f"({data['mode']}, engine {data['dtype']}, fault {data['fault']}); tolerance {tol:g} relative "
                  f"({data['tolerance_from']}); {sum(data['seconds'].values()):.1f} s")
    per_layer = len(data["layer_types"]) <= MAX_LAYER_COLUMNS
    t = Table(title="first divergent decoder layer per request", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    for col in ("request", "layer", "type", "pos", "resp", "phase"):
        t.add_column(col, no_wrap=True)
    for i in range(len(data["layer_types"]) if per_layer else 0):
        t.add_column(f"L{i}", no_wrap=True, justify="right")
    for r in data["requests"]:
        errs = [_err(layer, tol) for layer in r["layers"]] if per_layer else []
        cells = [r["request_id"], *(_cell(r.get(k)) for k in ("first_divergent_layer", "layer_type", "position",
                                                                 "response_position", "phase"))]
        t.add_row(*(escape(c) for c in cells), *errs, style=None if r["tokens_match"] else "yellow")
    console.print(t)
    console.print("pos: token position in prompt + response (0: the first prompt token); resp: the same from the "
                  "first response token; phase: the engine computed it in a prefill or a decode step"
                  + ("; L<i>: layer i's largest relative error ||h_vllm - h_ref|| / ||h_ref|| over the positions, "
                     "red over the tolerance; layer types: "
                     + " ".join(f"{i} {k}" for i, k in enumerate(data["layer_types"])) if per_layer else ""))
    notes = [f"{r['request_id']}: {r['note']}" for r in data["requests"] if r.get("note")]
    for line in notes[:5]:
        console.print(f"[yellow]note[/]: {escape(line)}")
    routed = [f"{r['request_id']}: {routing_words(r['routing'])}" for r in data["requests"] if r.get("routing")]
    for line in routed[:MAX_ROUTING_LINES]:
        console.print(f"[cyan]moe[/]: {escape(line)}")
    color = "bold red" if any(r.get("first_divergent_layer") is not None for r in data["requests"]) else "green"
    console.print(f"[{color}]{escape(summary_line(data))}[/]")
    if routing_summary(data["requests"]):
        console.print(f"[cyan]{escape(routing_summary(data['requests']))}[/]")
    if data.get("plot"):
        console.print(f"plot: {escape(data['plot'])}")


def _cell(x: Any) -> str:
    return "-" if x is None else str(x)


def _err(layer: dict[str, Any], tol: float) -> str:
    v = layer["max_rel_err"]
    v = float("inf") if v == "inf" else v
    text = f"{v:.0e}"
    return f"[red]{text}[/]" if v > tol else text


def draw_layers(ax: Any, data: dict[str, Any]) -> None:
    """The per-layer plot on `ax`: each request's max relative error per layer (log scale), the
    tolerance as a dashed line, the layer types on the x axis."""
    import numpy as np

    tol = data["tolerance"]
    xs = np.arange(len(data["layer_types"]))
    finite_max = tol
    for r in data["requests"][:MAX_LINES]:
        ys = np.array([float("inf") if v == "inf" else v for v in (layer["max_rel_err"] for layer in r["layers"])])
        ys = np.where(np.isfinite(ys), ys, np.nan)
        finite_max = max(finite_max, np.nanmax(ys, initial=0.0))
        diverged = r.get("first_divergent_layer") is not None
        ax.plot(xs, np.maximum(ys, 1e-12), "o-", lw=0.9, ms=3, alpha=0.8, color="#d62728" if diverged else "#555555")
        if diverged:
            k = r["first_divergent_layer"]
            ax.plot([k], [max(ys[k], 1e-12)], "s", ms=6, mfc="none", color="#d62728")
    ax.axhline(tol, color="#1f77b4", ls="--", lw=0.8)
    ax.text(0.995, tol, f"tolerance {tol:g}", ha="right", va="bottom", color="#1f77b4", fontsize=7,
            transform=ax.get_yaxis_transform())
    ax.set_yscale("log")
    ax.set_ylim(top=max(finite_max, tol) * 3)
    ax.set_xticks(list(xs), [f"{i}\n{t}" for i, t in enumerate(data["layer_types"])], fontsize=7)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("max relative error vs HF")


def plot_localization(result: Any, path: Path) -> Path:
    """The per-layer plot of a `LocalizeResult` as a PNG at `path` (ImportError without matplotlib)."""
    import logging

    from matplotlib.figure import Figure

    logging.getLogger("matplotlib.font_manager").setLevel(logging.WARNING)  # "findfont: ..." lines, once per process
    data = result.to_dict()
    fig = Figure(figsize=(max(6.0, 0.6 * len(data["layer_types"]) + 2), 3.6), layout="constrained")
    ax = fig.add_subplot()
    draw_layers(ax, data)
    fig.suptitle(f"{Path(data['path']).name} ({data['mode']}, fault {data['fault']})\n{summary_line(data)}", fontsize=8)
    fig.savefig(path, dpi=110)
    return path
