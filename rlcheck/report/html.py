"""The report page: one self-contained HTML file. CSS and SVG inline, no script, nothing fetched.

Every piece of text that comes from the run (paths, metric names, alarm messages, request ids,
context values) goes through `html.escape`; links to the dumps are relative to the page's folder.
"""

from __future__ import annotations

import html
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from rlcheck import __version__
from rlcheck.core import metrics as K
from rlcheck.report import plots
from rlcheck.report.data import MOE_PANELS, PANELS, Panel, RunData
from rlcheck.report.guard import guard_section
from rlcheck.report.localize import localize_section
from rlcheck.report.turns import turn_section

MAX_ALARM_ROWS = 500
MAX_LIST = 20
CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 0;
       color: #222; background: #fff; }
main { max-width: 1500px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0 2px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.muted { color: #666; } code, .mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
.verdict { border-left: 5px solid #2ca02c; background: #f3faf3; padding: 8px 14px; margin: 12px 0; }
.verdict.bad { border-color: #d62728; background: #fdf3f3; } .verdict ul { margin: 4px 0; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(370px, 1fr)); gap: 10px 18px; }
figure { margin: 0; } figcaption { font-size: 13px; font-weight: 600; margin-bottom: 2px; }
svg { max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { border-bottom: 1px solid #e6e6e6; padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.sev { display: inline-block; padding: 0 6px; border-radius: 3px; color: #fff; font-size: 12px; }
.sev.critical { background: #d62728; } .sev.warn { background: #ff7f0e; } .sev.info { background: #1f77b4; }
.dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin: 0 4px 0 10px; }
.row { display: flex; flex-wrap: wrap; gap: 0 40px; } .row > section { flex: 1 1 520px; min-width: 0; }
.kv { columns: 3 300px; column-gap: 28px; margin: 6px 0; } .kv div { break-inside: avoid; }
.kv .k { color: #555; margin-right: 8px; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else _e(x if x is not None else "-")


def _short(metric: str) -> str:
    return metric.removeprefix(K.PREFIX)


def _capped(items: list[Any], limit: int = MAX_LIST) -> str:
    """The first `limit` items, comma-separated, and how many more there are (not escaped)."""
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(str(i) for i in items[:limit]) + more


def render(data: RunData, out_dir: Path) -> str:
    """The whole page; links to the dumps are relative to `out_dir`."""
    body = "\n".join((_header(data), _context(data), _alarms(data), _metrics(data), _moe(data), turn_section(data, _panel),
                      f"<div class=\"row\"><section>{_periodic(data)}</section><section>{_histogram(data)}</section></div>",
                      _offenders(data), guard_section(data.guard, lambda p: _link(p, out_dir)),
                      localize_section(data.localizations, lambda p: _link(p, out_dir)), _dumps(data, out_dir)))
    title = _e(f"rlcheck report: {data.run_dir.name}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{title}</title>"
            f"<style>{CSS}</style></head>\n<body><main>\n{body}\n</main></body></html>\n")


def _header(data: RunData) -> str:
    s, d = data.summary, data.diagnosis
    v = d.verdict
    lines = [f"<li>{_e(x)}</li>" for x in v.evidence]
    if v.affected_steps:
        lines.append(f"<li>affected steps: {_e(_capped(v.affected_steps))}</li>")
    if v.affected_request_ids:
        lines.append(f"<li>affected requests: <span class=\"mono\">{_e(_capped(v.affected_request_ids))}</span></li>")
    others = "".join(f"<p class=\"muted\">also possible: {_e(f.title)} (confidence {f.confidence:.2f}): "
                     f"{_e(f.evidence[0] if f.evidence else '')}</p>" for f in d.findings[1:])
    skipped = f", {s['skipped_lines']} unreadable lines skipped" if s["skipped_lines"] else ""
    return (
        f"<h1>rlcheck report</h1><div class=\"mono\">{_e(data.run_dir)}</div>"
        f"<p class=\"muted\">{s['num_steps']} steps ({s['first_step']}..{s['last_step']}){_e(skipped)}, "
        f"{len(data.alarms)} alarms, {len(data.dumps)} dumps; generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))} "
        f"by rlcheck {_e(__version__)}</p>"
        f"<div class=\"verdict{'' if d.healthy else ' bad'}\"><b>diagnosis:</b> {_e(v.title)} "
        f"(confidence {v.confidence:.2f})<ul>{''.join(lines)}</ul></div>{others}"
    )


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _flatten(value, f"{name}.")
        else:
            out.append((name, value if isinstance(value, (str, int, float)) else json.dumps(value, default=str)))
    return out


def _context(data: RunData) -> str:
    rows = _flatten(data.context)
    if data.loop:
        skipped = [r["step"] for r in data.loop if r.get("sync_skipped")]
        rows.append(("loop steps", len(data.loop)))
        if skipped:
            rows.append(("weight sync skipped at steps", _capped(skipped)))
        phases = sorted({p for r in data.loop for p in (r.get("seconds") or {})})
        med = {p: statistics.median(r["seconds"][p] for r in data.loop if p in (r.get("seconds") or {})) for p in phases}
        rows.append(("median seconds per step", ", ".join(f"{p} {v:.3f}" for p, v in med.items())))
    if not rows:
        return "<h2>Context</h2><p class=\"muted\">no context recorded (no dump, no loop.jsonl)</p>"
    items = "".join(f"<div><span class=\"k\">{_e(k)}</span><span class=\"mono\">{_e(v)}</span></div>" for k, v in rows)
    return f"<h2>Context</h2><div class=\"kv\">{items}</div>"


def _alarms(data: RunData) -> str:
    groups = data.summary["alarms"]
    if not groups:
        return "<h2>Alarms</h2><p>no alarms</p>"
    rows = "".join(
        f"<tr><td><span class=\"sev {_e(g['severity'])}\">{_e(g['severity'])}</span></td><td>{_e(g['kind'])}</td>"
        f"<td class=\"mono\">{_e(_short(g['metric']))}</td><td class=\"num\">{g['count']}</td>"
        f"<td>{g['first_step']}..{g['last_step']}</td><td>{_e(g['message'])}</td></tr>" for g in groups)
    every = "".join(
        f"<tr><td class=\"num\">{_e(a.get('step'))}</td><td><span class=\"sev {_e(a.get('severity'))}\">"
        f"{_e(a.get('severity'))}</span></td><td>{_e(a.get('kind'))}</td><td class=\"mono\">{_e(_short(str(a.get('metric'))))}"
        f"</td><td>{_e(a.get('message'))}</td></tr>" for a in data.alarms[:MAX_ALARM_ROWS])
    more = f" (the first {MAX_ALARM_ROWS} shown)" if len(data.alarms) > MAX_ALARM_ROWS else ""
    return (
        "<h2>Alarms</h2><table><tr><th>severity</th><th>kind</th><th>metric</th><th>count</th><th>steps</th>"
        f"<th>last message</th></tr>{rows}</table><details><summary>every alarm ({len(data.alarms)}){more}</summary>"
        f"<table><tr><th>step</th><th>severity</th><th>kind</th><th>metric</th><th>message</th></tr>{every}</table></details>"
    )


def _metrics(data: RunData) -> str:
    marks = [int(r["step"]) for r in data.loop if r.get("sync_skipped")]
    panels = [p for p in PANELS if any(k in data.series for k in p.keys)]
    plotted = {k for p in panels for k in p.keys}
    figs = []
    for i, panel in enumerate(panels):
        mine = [a for a in data.alarms if a.get("metric") in panel.keys or (i == 0 and a.get("metric") not in plotted)]
        figs.append(_panel(f"series{i}", panel, data, mine, marks))
    legend = "".join(f"<span class=\"dot\" style=\"background:{c}\"></span>{s}" for s, c in plots.SEVERITY_COLORS.items())
    note = " Grey lines: steps after whose update the weight sync was left out (loop.jsonl)." if marks else ""
    return (f"<h2>Metrics per step</h2><p class=\"muted\">Alarms{legend}, each on the plot of its metric; "
            f"the first plot also carries those on metrics not plotted here. Hover a marker for its alarms.{note}</p>"
            f"<div class=\"grid\">{''.join(figs)}</div>")


def _panel(name: str, panel: Panel, data: RunData, alarms: list[dict[str, Any]], marks: list[int]) -> str:
    """One time-series figure: the panel's keys over the steps, `alarms` marked, its caption."""
    svg = plots.series_svg(name, panel, data.steps, data.series, plots.alarm_steps(alarms), marks)
    keys = "".join(f"<span class=\"dot\" style=\"background:{c}\"></span><span class=\"mono\">{_e(_short(k))}</span>"
                   for c, k in zip(plots.LINE_COLORS, panel.keys, strict=False) if k in data.series)
    return (f"<figure class=\"plot\"><figcaption>{_e(panel.title)}{keys if len(panel.keys) > 1 else ''}"
            f"</figcaption>{svg}</figure>")


def _moe(data: RunData) -> str:
    """The MoE routing section ("" unless the records carry routing agreement, `RunData.moe_layers`)."""
    if not data.moe_layers:
        return ""
    figs = [_panel(f"moe{i}", p, data, [a for a in data.alarms if a.get("metric") in p.keys], [])
            for i, p in enumerate(MOE_PANELS) if p.keys[0] in data.series]
    nan = np.full(data.steps.size, np.nan)
    agree = np.stack([data.series.get(K.moe_layer_agree(i), nan) for i in range(data.moe_layers)])  # (L, S)
    figs.append("<figure class=\"plot\"><figcaption>tokens routed alike, per MoE layer and step (fraction; the "
                f"lowest of merged steps)</figcaption>{plots.layers_svg('moe-layers', data.steps, agree, 'agree')}</figure>")
    return (f"<h2>MoE routing</h2><p class=\"muted\">Do the engine and the trainer send each token to the same "
            f"experts? {data.moe_layers} MoE layers; a token agrees at a layer when both sides chose the same top-k "
            f"expert set. <code>rlcheck localize</code> on a dump names each request's first MoE layer that differs.</p>"
            f"<p>{_e(_moe_words(data, nan))}</p><div class=\"grid\">{''.join(figs)}</div>")


def _moe_words(data: RunData, nan: np.ndarray) -> str:
    """The run's routing agreement in a sentence: its median and lowest step, the most common first layer."""
    parts = []
    frac = data.series.get(K.MOE_ROUTE_AGREE_FRAC, nan)
    if np.isfinite(frac).any():
        parts.append(f"tokens routed to the same experts at every MoE layer: median {np.nanmedian(frac):.4g}, "
                     f"lowest {np.nanmin(frac):.4g} at step {data.steps[np.nanargmin(frac)]}")
    first = [float(np.nansum(data.series.get(K.moe_first_diff(i), nan))) for i in range(data.moe_layers)]
    if sum(first):
        parts.append(f"routing first differs most often at MoE layer {int(np.argmax(first))} ({max(first):,.0f} of "
                     f"the {sum(first):,.0f} tokens routed differently over the run)")
    return "; ".join(parts)


def _periodic(data: RunData) -> str:
    if not data.periodograms:
        return ("<h2>Periodic spikes</h2><p class=\"muted\">too few steps for the periodic detector "
                "(its baseline warms up over 32 steps)</p>")
    out = ["<h2>Periodic spikes</h2>"]
    for i, pg in enumerate(data.periodograms):
        if pg.period is not None:
            found = (f"<p><b>detected period {pg.period}</b> (phase {pg.phase}, at step {pg.step}): "
                     f"{_e(pg.message)}</p>")
        else:
            found = f"<p>no periodic alarm: no period passed the decision level at step {pg.step}</p>"
        out.append(
            f"{found}<figure class=\"plot\"><figcaption>fold score of <span class=\"mono\">{_e(_short(pg.metric))}</span> "
            f"per period at step {pg.step} (the periodic detector's statistic over the {pg.history} z-scores it held: "
            f"periods up to {pg.periods[-1]} testable)</figcaption>"
            f"{plots.periodogram_svg(f'periodogram{i}', pg)}</figure>")
    return "".join(out)


def _histogram(data: RunData) -> str:
    hist = data.hist_run
    total = sum(hist["counts"])
    if not total:
        return "<h2>|d| histogram</h2><p class=\"muted\">no histogram logged</p>"
    zeros = sum(c for b, c in zip(hist["bins"], hist["counts"], strict=True) if b == 0)
    svg = plots.histogram_svg("histogram", hist, data.hist_worst, data.worst_step)
    return (f"<h2>|d| histogram</h2><p class=\"muted\">{total:,} tokens over the run, {zeros:,} of them with "
            f"|d| below 2<sup>-30</sup> (exact matches, left off the log axis); the worst step by mean |d| is "
            f"{data.worst_step}.</p><figure class=\"plot\"><figcaption>|d| per token, as a fraction of the tokens"
            f"</figcaption>{svg}</figure>")


def _offender_table(rows: list[dict[str, Any]], with_step: bool) -> str:
    turns = any(o.get("turn") is not None for o in rows)  # multi-turn: the turn and offset of the first divergence
    head = ("<th>step</th>" if with_step else "") + "".join(
        f"<th>{h}</th>" for h in ("request id", "index", "max |d|", "mean d", "first divergence", "length")) + (
        "<th>turn</th><th>offset in turn</th>" if turns else "")
    body = "".join(
        "<tr>" + (f"<td class=\"num\">{_e(o.get('step'))}</td>" if with_step else "")
        + f"<td class=\"mono\">{_e(o.get('request_id'))}</td><td class=\"num\">{_e(o.get('index'))}</td>"
        f"<td class=\"num\">{_num(o.get('max_abs_diff'))}</td><td class=\"num\">{_num(o.get('mean_diff'))}</td>"
        f"<td class=\"num\">{_num(o.get('first_divergence'))}</td><td class=\"num\">{_num(o.get('length'))}</td>"
        + (f"<td class=\"num\">{_num(o.get('turn'))}</td><td class=\"num\">{_num(o.get('turn_offset'))}</td>"
           if turns else "") + "</tr>"
        for o in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _offenders(data: RunData) -> str:
    if not data.offenders:
        return "<h2>Offenders</h2><p class=\"muted\">no offenders logged</p>"
    return (f"<h2>Offenders</h2><div class=\"row\"><section><p>The run's worst sequences by max |d| (top "
            f"{len(data.offenders)} of the logged per-step offenders)</p>{_offender_table(data.offenders, True)}</section>"
            f"<section><p>Offenders of step {data.worst_step} (worst mean |d|)</p>"
            f"{_offender_table(data.worst_offenders, False)}</section></div>")


def _link(path: Path, out_dir: Path) -> str:
    rel = Path(os.path.relpath(path.resolve(), out_dir.resolve())).as_posix()
    return f"<a href=\"{_e(quote(rel))}\">{_e(path.name)}</a>"


def _dumps(data: RunData, out_dir: Path) -> str:
    if not data.dumps:
        return "<h2>Dumps</h2><p class=\"muted\">no dumps (the run did not halt, nothing was dumped on demand)</p>"
    rows = "".join(
        f"<tr><td class=\"num\">{d.step}</td><td class=\"mono\">{_e(d.path.name)}</td><td class=\"num\">"
        f"{_num(d.num_sequences)}</td><td>{' '.join(_link(f, out_dir) for f in d.files)}</td><td>{_e(d.reason)}</td></tr>"
        for d in data.dumps)
    return ("<h2>Dumps</h2><p class=\"muted\"><code>rlcheck replay DUMP</code> re-scores a dump with the HF "
            "reference; <code>rlcheck diagnose DUMP</code> names its cause.</p><table><tr><th>step</th><th>dump</th><th>sequences</th>"
            f"<th>files</th><th>reason</th></tr>{rows}</table>")
