"""Console output of the forensic commands (rich)."""

from __future__ import annotations

from typing import Any


def render_diagnosis(diagnosis, console: Any, max_ids: int = 10) -> None:
    v = diagnosis.verdict
    color = "green" if diagnosis.healthy else "red"
    console.print(f"{diagnosis.source} {diagnosis.path}: {diagnosis.num_steps} step(s)")
    console.print(f"[bold {color}]likely cause[/]: {v.title} (confidence {v.confidence:.2f})")
    for line in v.evidence:
        console.print(f"  - {line}")
    if v.affected_steps:
        steps = v.affected_steps
        more = f" (+{len(steps) - 12} more)" if len(steps) > 12 else ""
        console.print(f"  affected steps: {', '.join(map(str, steps[:12]))}{more}")
    if v.affected_request_ids:
        ids = v.affected_request_ids
        more = f" (+{len(ids) - max_ids} more)" if len(ids) > max_ids else ""
        console.print(f"  affected requests: {', '.join(ids[:max_ids])}{more}")
    for f in diagnosis.findings[1:]:
        console.print(f"also possible: {f.title} (confidence {f.confidence:.2f}): {f.evidence[0]}")
