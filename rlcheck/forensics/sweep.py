"""`rlcheck sweep --model DIR --knob max_num_seqs=2,4,8,16`: change one knob at a time and record
when and where failures appear, the failure's shape (design.md, background/).

    knobs = [parse_knob("max_num_seqs=2,4,8,16"), parse_knob("kv_cache_bytes=700KiB,1MiB,8MiB")]
    result = run_sweep(StressConfig(model=..., fault="index-wrap", boundary=8), knobs)
    result.points                         # one SweepPoint per knob value
    write_sweep(result, "runs/sweep")     # rlcheck.forensics.stress.report: sweep.json and sweep.png

Every value of every knob is one `rlcheck stress` run on the base settings with that knob changed
(the others stay at the base); per value: failures, the arrival index of the first failing request,
the failing fraction and how many of the first wave (requests given a never-used state slot) fail;
with `audits`, per value also the decode-prefill failures and the requests that differ between the
batch-invariance runs (`--audit batch-invariance --knob max_num_seqs=...`: how batch invariance
changes with concurrency; the max_num_seqs 1 run they are compared with is made once).
The two Mamba faults read apart this way: stale state never touches the first wave and grows as
memory shrinks (fewer slots, more reuse); a wrapped index appears once concurrency pushes block ids
past its boundary and vanishes when memory is cut, the misleading lever of the original bug.

Knobs: kv_cache_bytes (the cache budget; 700KiB, 8MiB, ...), max_num_seqs (concurrency),
samples_per_prompt (the number of distinct prompts stays the base's, so requests grow with it, as
rollouts per prompt do in RL), max_num_batched_tokens (tokens per engine step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.forensics.stress import run_stress
from rlcheck.forensics.stress.config import Progress, StressConfig, parse_size
from rlcheck.forensics.stress.results import SweepPoint, SweepResult

__all__ = ["ALIASES", "KNOBS", "SWEEP_REQUESTS", "Knob", "SweepPoint", "SweepResult", "knob_config", "parse_knob",
           "parse_size", "run_sweep"]

KNOBS = ("kv_cache_bytes", "max_num_seqs", "samples_per_prompt", "max_num_batched_tokens")
ALIASES = {"kv": "kv_cache_bytes", "cache": "kv_cache_bytes", "memory": "kv_cache_bytes", "seqs": "max_num_seqs",
           "samples": "samples_per_prompt", "n": "samples_per_prompt", "batched_tokens": "max_num_batched_tokens"}
SWEEP_REQUESTS = 256
"""Requests per run of a sweep (fewer than a stress run sends by default: one run per knob value)."""


@dataclass(frozen=True)
class Knob:
    name: str  # a StressConfig field, one of KNOBS
    values: tuple[int, ...]


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


def run_sweep(base: StressConfig, knobs: list[Knob], *, progress: Progress | None = None,
              scorer: Any = None) -> SweepResult:
    """One stress run per knob value (see the module docstring); one HF reference for them all."""
    from rlcheck.forensics.replay import load_scorer, resolve_model

    if not knobs:
        raise ConfigError("sweep needs at least one --knob NAME=V1,V2,...")
    base = replace(base, boundary=base.fault_boundary)  # the wrap boundary stays put while max_num_seqs moves
    if base.reference:
        scorer = scorer or load_scorer(resolve_model({}, base.model), base.reference_config())
    serial: dict = {}  # batch-invariance's max_num_seqs 1 runs, one per distinct setting
    total = sum(len(k.values) for k in knobs)
    points: list[SweepPoint] = []
    for knob in knobs:
        for value in knob.values:
            label = f"{knob.name}={value} ({len(points) + 1}/{total})"
            report = None if progress is None else (lambda phase, d, t, label=label: progress(f"{label} {phase}", d, t))
            result = run_stress(knob_config(base, knob.name, value), progress=report, scorer=scorer, serial_cache=serial)
            points.append(SweepPoint.of(knob.name, value, result))
    return SweepResult(base, tuple(points))
