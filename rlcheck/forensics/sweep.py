"""`rlcheck sweep --model DIR --knob max_num_seqs=2,4,8,16`: change one knob at a time and record
when and where failures appear, the failure's shape (design.md, background/).

    knobs = [parse_knob("max_num_seqs=2,4,8,16"), parse_knob("kv_cache_bytes=700KiB,1MiB,8MiB")]
    result = run_sweep(StressConfig(model=..., fault="index-wrap", boundary=8), knobs)
    write_sweep(result, "runs/sweep")     # sweep.json (the table) and sweep.png (the plot)

Every value of every knob is one `rlcheck stress` run on the base settings with that knob changed
(the others stay at the base); per value: failures, the arrival index of the first failing request,
the failing fraction and how many of the first wave (requests given a never-used state slot) fail.
The two Mamba faults read apart this way: stale state never touches the first wave and grows as
memory shrinks (fewer slots, more reuse); a wrapped index appears once concurrency pushes block ids
past its boundary and vanishes when memory is cut, the misleading lever of the original bug.

Knobs: kv_cache_bytes (the cache budget; 700KiB, 8MiB, ...), max_num_seqs (concurrency),
samples_per_prompt (the number of distinct prompts stays the base's, so requests grow with it, as
rollouts per prompt do in RL), max_num_batched_tokens (tokens per engine step).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.forensics.stress import Progress, StressConfig, StressResult, run_stress

KNOBS = ("kv_cache_bytes", "max_num_seqs", "samples_per_prompt", "max_num_batched_tokens")
ALIASES = {"kv": "kv_cache_bytes", "cache": "kv_cache_bytes", "memory": "kv_cache_bytes", "seqs": "max_num_seqs",
           "samples": "samples_per_prompt", "n": "samples_per_prompt", "batched_tokens": "max_num_batched_tokens"}
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
RESULT_FILE, PLOT_FILE = "sweep.json", "sweep.png"
SWEEP_REQUESTS = 256
"""Requests per run of a sweep (fewer than a stress run sends by default: one run per knob value)."""


@dataclass(frozen=True)
class Knob:
    name: str  # a StressConfig field, one of KNOBS
    values: tuple[int, ...]


def parse_size(text: str) -> int:
    """Bytes from "8388608", "8MiB", "8M", "512KiB", "1GiB" (binary units, any case)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ConfigError(f"{text!r} is not a size: write bytes, or a number with KiB, MiB or GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_knob(text: str) -> Knob:
    """`--knob NAME=V1,V2,...` (NAME: one of KNOBS or ALIASES; sizes for kv_cache_bytes)."""
    name, sep, values = text.partition("=")
    name = ALIASES.get(name.strip(), name.strip())
    if not sep or name not in KNOBS or not values.strip():
        raise ConfigError(f"--knob {text!r}: write NAME=V1,V2,... with NAME one of {', '.join(KNOBS)} "
                          f"(or {', '.join(ALIASES)})")
    try:
        parsed = tuple(parse_size(v) if name == "kv_cache_bytes" else int(v) for v in values.split(","))
    except ValueError as exc:  # int() of a non-number, or parse_size's own message
        raise ConfigError(f"--knob {text!r}: {exc}") from None
    if min(parsed) < 1 or len(set(parsed)) != len(parsed):
        raise ConfigError(f"--knob {text!r}: values must be distinct and >= 1")
    return Knob(name, parsed)


def knob_config(base: StressConfig, knob: str, value: int) -> StressConfig:
    """The base settings with one knob changed (samples_per_prompt keeps the number of prompts)."""
    if knob == "samples_per_prompt":
        num_prompts = -(-base.num_requests // base.samples_per_prompt)
        return replace(base, samples_per_prompt=value, num_requests=num_prompts * value)
    return replace(base, **{knob: value})


@dataclass(frozen=True)
class SweepPoint:
    knob: str
    value: int
    num_requests: int
    num_failing: int
    failing_fraction: float
    first_failing_index: int | None  # arrival index of the first failing request
    first_wave: int | None  # requests given a never-used state slot (None: no slot trace)
    first_wave_failing: int | None
    num_blocks: int | None
    seconds: float
    failing_request_ids: tuple[str, ...]

    @classmethod
    def of(cls, knob: str, value: int, r: StressResult) -> SweepPoint:
        wave = r.first_wave
        return cls(knob, value, r.num_requests, len(r.failing), r.failing_fraction, r.first_failing_index,
                   None if wave is None else wave[0], None if wave is None else wave[1], r.num_blocks,
                   sum(r.seconds.values()), tuple(r.failing_request_ids))


@dataclass(frozen=True)
class SweepResult:
    base: StressConfig
    points: tuple[SweepPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"base": asdict(self.base), "points": [asdict(p) for p in self.points]}


def run_sweep(base: StressConfig, knobs: list[Knob], *, progress: Progress | None = None,
              scorer: Any = None) -> SweepResult:
    """One stress run per knob value (see the module docstring); one HF reference for them all."""
    from rlcheck.forensics.replay import load_scorer, resolve_model

    if not knobs:
        raise ConfigError("sweep needs at least one --knob NAME=V1,V2,...")
    base = replace(base, boundary=base.fault_boundary)  # the wrap boundary stays put while max_num_seqs moves
    scorer = scorer or load_scorer(resolve_model({}, base.model))
    total = sum(len(k.values) for k in knobs)
    points: list[SweepPoint] = []
    for knob in knobs:
        for value in knob.values:
            label = f"{knob.name}={value} ({len(points) + 1}/{total})"
            report = None if progress is None else (lambda phase, d, t, label=label: progress(f"{label} {phase}", d, t))
            result = run_stress(knob_config(base, knob.name, value), progress=report, scorer=scorer)
            points.append(SweepPoint.of(knob.name, value, result))
    return SweepResult(base, tuple(points))


def write_sweep(result: SweepResult, out_dir: str | Path) -> tuple[Path, Path | None]:
    """sweep.json (the table) and sweep.png (the plot; None when matplotlib is missing) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / RESULT_FILE
    try:
        png: Path | None = plot_sweep(result, out / PLOT_FILE)
    except ImportError:
        png = None
    table.write_text(json.dumps({**result.to_dict(), "plot": None if png is None else str(png)}, indent=1))
    return table, png


def show_value(knob: str, value: int) -> str:
    """kv_cache_bytes in the largest binary unit that divides it; other knobs as they are."""
    if knob != "kv_cache_bytes":
        return str(value)
    unit = next((u for u in ("G", "M", "K") if value % UNITS[u.lower()] == 0), "")
    return f"{value // UNITS[unit.lower()]}{unit}iB" if unit else f"{value}B"


def plot_sweep(result: SweepResult, path: Path) -> Path:
    """One panel per knob: failing fraction (bars) and first failing arrival index (dots) per value."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    knobs = list(dict.fromkeys(p.knob for p in result.points))
    fig = Figure(figsize=(4.5 * len(knobs), 3.6), layout="constrained")
    for ax, knob in zip(fig.subplots(1, len(knobs), squeeze=False)[0], knobs, strict=True):
        pts = [p for p in result.points if p.knob == knob]
        xs = range(len(pts))
        bars = ax.bar(xs, [p.failing_fraction for p in pts], color="tab:red", alpha=0.7)
        ax.bar_label(bars, [f"{p.num_failing}/{p.num_requests}" for p in pts], fontsize=8)
        ax.set_xticks(list(xs), [show_value(knob, p.value) + (f"\n{p.num_blocks} blocks" if p.num_blocks else "")
                                 for p in pts], fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(knob)
        ax.set_ylabel("failing fraction (bars)")
        right = ax.twinx()
        firsts = [(x, p.first_failing_index) for x, p in zip(xs, pts, strict=True) if p.first_failing_index is not None]
        right.plot([x for x, _ in firsts], [f for _, f in firsts], "o", color="black")
        right.yaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_ylim(bottom=0, top=max([f for _, f in firsts] + [1]) * 1.15)
        right.set_ylabel("first failing request (arrival index, dots)")
    b = result.base
    fig.suptitle(f"{Path(b.model).name}: fault {b.fault}" + (f" (boundary {b.boundary})" if b.boundary else "")
                 + f", {b.num_requests} requests, {b.max_tokens} tokens", fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def render_sweep(result: SweepResult, console: Any) -> None:
    """The table: one row per knob value."""
    from rich import box
    from rich.table import Table

    t = Table(title="one knob at a time, the others at the base", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    for col in ("knob", "value", "blocks", "reqs", "fail", "frac", "1st fail", "wave", "s"):
        t.add_column(col, no_wrap=True)
    for i, p in enumerate(result.points):
        knob = p.knob if i == 0 or result.points[i - 1].knob != p.knob else ""
        wave = "-" if p.first_wave is None else f"{p.first_wave_failing}/{p.first_wave}"
        first = "-" if p.first_failing_index is None else str(p.first_failing_index)
        t.add_row(knob, show_value(p.knob, p.value), str(p.num_blocks or "-"), str(p.num_requests),
                  str(p.num_failing), f"{p.failing_fraction:.1%}", first, wave, f"{p.seconds:.1f}",
                  style="red" if p.num_failing else None)
    console.print(t)
    console.print("1st fail: arrival index of the first failing request; wave: failing / size of the first wave "
                  "(requests given a never-used state slot)")
