"""The report's engine guard section: the lifecycle invariants the guard checked inside vLLM's forward
pass, the ones it saw broken (per check, then each violation with its request, engine step and slot),
and links to the break snapshots. Empty when the run directory holds no guard output."""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ROWS = 50


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def guard_section(guard: Any, link: Callable[[Path], str]) -> str:
    """HTML of `guard` (`rlcheck.core.run.guard_files.GuardData`, or None: ""); `link(path)` makes a
    relative link to a snapshot file."""
    if guard is None:
        return ""
    from rlcheck.core.run.guard_record import CHECKS

    s = guard.summary
    pool = s.get("pool") or {}
    worst = max((g.get("pool_end_offset", 0) for g in (pool.get("groups") or {}).values()), default=None)
    offsets = (f"; the pool's largest end offset is {worst:,} elements of a {pool.get('offset_limit', 0):,} limit"
               if worst is not None else "")
    head = (f"<h2>Engine guard</h2><p class=\"muted\">vLLM's scheduler and state-slot invariants, checked at each of "
            f"{_e(s.get('num_steps', '?'))} forward steps inside the engine ({_e(pool.get('num_blocks', '?'))} blocks"
            f"{_e(offsets)}). The guard reads the cause where it happens; the metrics above show the symptom.</p>")
    if s.get("error"):
        head += f"<p><b>the guard stopped:</b> {_e(s['error'])}</p>"
    by_check = guard.by_check()
    counts = s.get("counts") or {}
    rows = "".join(
        f"<tr><td>{_e(text.split(' ', 1)[0])}</td><td class=\"mono\">{_e(check)}</td><td>{_e(text.split(' ', 1)[1])}</td>"
        f"<td class=\"num\">{counts.get(check, 0)}</td><td class=\"num\">{len(by_check.get(check, []))}</td>"
        f"<td>{_e(by_check[check][0].message) if by_check.get(check) else 'held'}</td></tr>"
        for check, text in CHECKS.items())
    table = ("<table><tr><th>invariant</th><th>check</th><th>what it requires</th><th>occurrences</th>"
             f"<th>requests</th><th>first violation</th></tr>{rows}</table>")
    return head + table + _violations(guard.violations) + _snapshots(guard.snapshots, link)


def _violations(violations: list[Any]) -> str:
    if not violations:
        return "<p>no invariant broken</p>"
    rows = "".join(
        f"<tr><td class=\"num\">{v.step}</td><td class=\"num\">{_e('-' if v.call_step is None else v.call_step)}</td>"
        f"<td class=\"mono\">{_e(v.rollout_request_id or v.request_id)}</td><td>{_e(v.invariant)} {_e(v.check)}</td>"
        f"<td class=\"num\">{_e('-' if v.slot is None else v.slot)}</td><td>{_e(v.message)}</td></tr>"
        for v in violations[:MAX_ROWS])
    more = f" (the first {MAX_ROWS} shown)" if len(violations) > MAX_ROWS else ""
    return (f"<details open><summary>violations ({len(violations)}, the first per request and check){more}</summary>"
            "<table><tr><th>engine step</th><th>step</th><th>request</th><th>invariant</th><th>slot</th><th>what</th></tr>"
            f"{rows}</table></details>")


def _snapshots(paths: list[Path], link: Callable[[Path], str]) -> str:
    if not paths:
        return ""
    items = " ".join(f"{_e(p.parent.name)}/{link(p)}" for p in paths[:MAX_ROWS])
    return f"<p>break snapshots (RLCHECK_BREAK_ON): {items}</p>"
