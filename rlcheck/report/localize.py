"""The report's "Where did it diverge?" section: for each dump `rlcheck localize` has run on, the first
divergent decoder layer of every localized request (with its position; on an MoE, where its routing
first differs) and the per-layer plot of their largest relative errors against the HF reference. Empty
when no dump has been localized."""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ROWS = 50


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def localize_section(localizations: list[dict[str, Any]], link: Callable[[Path], str]) -> str:
    """HTML of the localized dumps ("" without any); `link(path)` makes a relative link to a file."""
    if not localizations:
        return ""
    parts = ["<h2>Where did it diverge?</h2><p class=\"muted\"><code>rlcheck localize</code> re-ran the worst "
             "requests of a dump through vLLM with a hook on every decoder layer and compared each layer's hidden "
             "state with the HF reference's, position by position (relative L2 error). The first divergent layer is "
             "the lowest whose error passes the tolerance; position counts the tokens of prompt + response from 0.</p>"]
    for i, data in enumerate(localizations):
        parts.append(_one(f"localize{i}", data, link))
    return "".join(parts)


def _one(name: str, data: dict[str, Any], link: Callable[[Path], str]) -> str:
    from rlcheck.forensics.localize.report import summary_line
    from rlcheck.forensics.localize.routing import routing_summary
    from rlcheck.report.plots import localize_svg

    path = Path(str(data.get("path", "")))
    png = data.get("plot")
    files = f" ({link(Path(png))})" if png and Path(png).is_file() else ""
    tol = data["tolerance"]
    head = (f"<h3 class=\"mono\">{_e(path.name)}</h3><p>{_e(summary_line(data))}. {_e(data['mode'])}, engine "
            f"{_e(data['dtype'])}, fault {_e(data['fault'])}, tolerance {tol:g} ({_e(data['tolerance_from'])}){files}</p>")
    types = data["layer_types"]
    moe = any(r.get("routing") for r in data["requests"])
    cols = "".join(f"<th>L{i} {_e(t)}</th>" for i, t in enumerate(types)) + ("<th>MoE routing</th>" if moe else "")
    rows = "".join(_row(r, tol, moe) for r in data["requests"][:MAX_ROWS])
    table = ("<table><tr><th>request</th><th>first layer</th><th>type</th><th>position</th><th>response position</th>"
             f"<th>phase</th>{cols}</tr>{rows}</table>")
    if moe:
        head += f"<p>{_e(routing_summary(data['requests']))}</p>"
    figure = (f"<figure class=\"plot\"><figcaption>max relative error per decoder layer, one line per request "
              f"(red: diverged; squares: the first divergent layer)</figcaption>{localize_svg(name, data)}</figure>")
    return f"<div class=\"row\"><section>{head}{table}</section><section>{figure}</section></div>"


def _row(r: dict[str, Any], tol: float, moe: bool) -> str:
    from rlcheck.forensics.localize.routing import routing_words

    def cell(x: Any) -> str:
        return "-" if x is None else _e(x)

    red = ' style="color:#d62728"'
    errs = "".join(f"<td class=\"num\"{red if _value(layer) > tol else ''}>{_value(layer):.1e}</td>"
                   for layer in r["layers"])
    if moe:
        errs += f"<td>{_e(routing_words(r['routing'])) if r.get('routing') else '-'}</td>"
    return (f"<tr><td class=\"mono\">{_e(r['request_id'])}</td><td class=\"num\">{cell(r['first_divergent_layer'])}</td>"
            f"<td>{cell(r['layer_type'])}</td><td class=\"num\">{cell(r['position'])}</td>"
            f"<td class=\"num\">{cell(r['response_position'])}</td><td>{cell(r['phase'])}</td>{errs}</tr>")


def _value(layer: dict[str, Any]) -> float:
    v = layer["max_rel_err"]
    return float("inf") if v == "inf" else float(v)
