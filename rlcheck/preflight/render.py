"""A preflight as text: the CLI's output and the adapters' warning block, one finding per paragraph,
worst first, then the probe and the verdict.

    print(render(result))
    ERROR rope_theta: trainer 10000.0 | engine 500000.0
          the RoPE base differs: every position after the first is rotated differently, ...
          fix: pass vLLM hf_overrides={'rope_theta': <the trainer's value>} (or load both sides from ...).
"""

from __future__ import annotations

import textwrap
from collections import Counter
from typing import Any

from rlcheck.preflight.findings import SEVERITIES, Finding, Preflight

WIDTH = 110
INDENT = " " * 9


def _value(value: Any) -> str:
    return "-" if value is None else str(value)


def render_finding(f: Finding) -> list[str]:
    """One finding: "SEVERITY key: trainer X | engine Y", what it does, the fix."""
    head = f"{f.severity.upper():<8} {f.key}: trainer {_value(f.trainer)} | engine {_value(f.engine)}"
    body = textwrap.wrap(f.message, WIDTH, initial_indent=INDENT, subsequent_indent=INDENT)
    fix = textwrap.wrap(f"fix: {f.fix}", WIDTH, initial_indent=INDENT, subsequent_indent=INDENT + "     ")
    return [head, *body, *fix]


def verdict(result: Preflight) -> str:
    """One line: how many findings would make the sides differ, by severity, and the notes."""
    counts = Counter(f.severity for f in result.findings)
    differ = sum(v for k, v in counts.items() if k != "info")
    notes = f"; {counts['info']} note(s)" if counts["info"] else ""
    if not differ:
        return f"nothing found that would make the two sides differ{notes}"
    parts = ", ".join(f"{counts[s]} {s}" for s in reversed(SEVERITIES) if s != "info" and counts[s])
    return f"{differ} setting(s) would make the two sides differ ({parts}){notes}"


def render_probe(result: Preflight) -> str:
    p = result.probe
    if p is None:
        return f"probe: {result.probe_note or 'not run'}"
    state = "ok" if p.ok else "FAILED"
    return (f"probe: {p.tokens} teacher-forced tokens, mean |d| {p.mean_abs:.3g}, max |d| {p.max_abs:.3g} nats "
            f"(tolerance {p.tolerance:g} on the mean): {state}")


def render(result: Preflight, title: str = "rlcheck preflight") -> str:
    """The whole preflight as text (see the module docstring)."""
    same = result.trainer_model == result.engine_model
    where = f"model {result.trainer_model}" if same else f"trainer {result.trainer_model} | engine {result.engine_model}"
    lines = [f"{title}: {where}"]
    for f in result.findings:
        lines += render_finding(f)
    if result.probe is not None or result.probe_note is not None:
        lines.append(render_probe(result))
    lines.append(verdict(result))
    return "\n".join(lines)
