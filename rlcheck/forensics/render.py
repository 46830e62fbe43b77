"""Console output of the forensic commands (rich), and the formatting helpers they share."""

from __future__ import annotations

from typing import Any

from rlcheck.forensics.stress.config import UNITS


def render_diagnosis(diagnosis, console: Any, max_ids: int = 10) -> None:
    from rich.markup import escape  # evidence quotes `logp_rollout[t+1]`, which rich would take for a tag

    v = diagnosis.verdict
    color = "green" if diagnosis.healthy else "red"
    console.print(f"{diagnosis.source} {escape(diagnosis.path)}: {diagnosis.num_steps} step(s)")
    console.print(f"[bold {color}]likely cause[/]: {escape(v.title)} (confidence {v.confidence:.2f})")
    for line in v.evidence:
        console.print(f"  - {escape(line)}")
    if v.affected_steps:
        steps = v.affected_steps
        more = f" (+{len(steps) - 12} more)" if len(steps) > 12 else ""
        console.print(f"  affected steps: {', '.join(map(str, steps[:12]))}{more}")
    if v.affected_request_ids:
        ids = v.affected_request_ids
        more = f" (+{len(ids) - max_ids} more)" if len(ids) > max_ids else ""
        console.print(f"  affected requests: {escape(', '.join(ids[:max_ids]))}{more}")
    for f in diagnosis.findings[1:]:
        console.print(f"also possible: {escape(f.title)} (confidence {f.confidence:.2f}): {escape(f.evidence[0])}")


def render_replay(report, console: Any, top: int = 20) -> None:
    """The replay's header, its `top` worst requests as a table, and the verdict against the threshold."""
    from rich.markup import escape
    from rich.table import Table

    r = report
    mode = "batched" if r.batched else "one at a time"
    console.print(
        f"{escape(r.dump_dir)}: step {r.step}, {len(r.records)} requests, {r.num_tokens:,} response tokens; "
        f"reference {escape(r.model)} ({r.reference_dtype} on {r.reference_device}) at T={r.temperature:g} "
        f"({r.temperature_from}); "
        f"scored in {r.score_seconds:.2f} s ({mode})"
    )
    t = Table(title=f"worst {min(top, len(r.records))} by max |d| vs the engine (d = reference - rollout)",
              title_justify="left")
    t.add_column("#", no_wrap=True)
    t.add_column("request id", overflow="fold")
    for col in ("max |d|\nengine", "max |d|\ntrainer", "first\ndiv", "logp\nengine/ref"):
        t.add_column(col, no_wrap=True)
    t.add_column("context", overflow="fold")
    for i, rec in enumerate(r.records[:top], 1):
        t.add_row(str(i), *(escape(cell) for cell in _replay_cells(rec)),
                  style="red" if rec.score > r.threshold else None)
    console.print(t)
    failed = r.failed
    if failed:
        console.print(f"[bold red]FAIL[/]: {len(failed)} of {len(r.records)} requests over max |d| {r.threshold:g} "
                      f"vs the engine (worst: {escape(failed[0].request_id)})")
    else:
        console.print(f"[green]OK[/]: all {len(r.records)} requests within max |d| {r.threshold:g} of the reference")


def _replay_cells(rec) -> tuple[str, ...]:
    ctx = rec.context
    return (
        rec.request_id,
        "non-finite" if rec.nonfinite else f"{rec.max_abs_diff:.3g}",
        "-" if rec.max_abs_diff_train is None else f"{rec.max_abs_diff_train:.3g}",
        "-" if rec.first_divergence is None else str(rec.first_divergence),
        "" if ctx is None else f"{ctx.logp_rollout:.3g}/{ctx.logp_reference:.3g}",
        "" if ctx is None else ctx.marked,
    )


def show_value(knob: str, value: int) -> str:
    """kv_cache_bytes in the largest binary unit that divides it; other knobs as they are."""
    if knob != "kv_cache_bytes":
        return str(value)
    unit = next((u for u in ("G", "M", "K") if value % UNITS[u.lower()] == 0), "")
    return f"{value // UNITS[unit.lower()]}{unit}iB" if unit else f"{value}B"
