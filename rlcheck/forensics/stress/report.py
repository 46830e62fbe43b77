"""What a stress run or a sweep leaves behind: the files and the console tables. A stress run: a dump
that `rlcheck diagnose` and `rlcheck replay` read, its stress.json, and the table of failing requests
(`write_stress`, `render_stress`). A sweep: sweep.json, sweep.png and its table (`write_sweep`,
`plot_sweep`, `render_sweep`). The results themselves live in `rlcheck.forensics.stress.results`.

The dump is one step (step 0) of every request: `logp_rollout` the engine's logprobs, `logp_train`
the HF reference's (the side that judges here), tokens, and per-sequence meta columns: `arrival`,
`prompt_index`, `sample_index`, `failed`, and with the slot trace `first_step`, `last_step`,
`batch_size`, `block`, `block_used`, `previous_holder`, `slot_reused`, `shared_with`
(`rlcheck.forensics.slots`). `max_abs_diff` and `first_divergence` use the stress threshold.
With the engine guard: a `guard_checks` column (the invariants each request broke), the guard's
summary in the meta's context ("guard") and its files in OUT/guard/ (`rlcheck.core.run.guard_files`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.forensics.render import show_value
from rlcheck.forensics.stress.results import StressResult, SweepResult, guard_dict

RESULT_FILE = "stress.json"
SWEEP_FILE, PLOT_FILE = "sweep.json", "sweep.png"
TRACE_COLUMNS = ("first_step", "last_step", "batch_size", "block", "block_used")
JUDGES = {"reference": "the HF reference (rlcheck stress judges the engine against it)",
          "decode-prefill": "the engine's own fresh prefill of prompt + response (rlcheck stress --no-reference "
                            "--audit decode-prefill judges the decode against it)"}
"""What the dump's `logp_train` is, by `StressResult.judge`."""


def write_stress(out: Path, result: StressResult, prompts: list[list[int]], rollouts: list[Any],
                 reference: list[np.ndarray] | None) -> StressResult:
    """Write the dump and stress.json into `out` (replaced); the result with its `dump_dir`. The dump's
    judging side (`logp_train`) is `reference`: the HF reference's logprobs, or the engine's fresh
    prefill (`--no-reference`); without either only stress.json is written."""
    if reference is None:
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=1))
        return result
    from rlcheck.core.batch import StepBatch
    from rlcheck.core.model_types import model_type_at
    from rlcheck.core.run.dump import write_dump
    from rlcheck.engines.vllm_env import vllm_record
    from rlcheck.forensics.stress.config import engine_config

    cfg, contexts = result.config, result.contexts
    failing = set(result.failing)
    n = result.num_requests
    meta: dict[str, list[Any]] = {
        "arrival": [c.arrival for c in contexts],
        "prompt_index": [i // cfg.samples_per_prompt for i in range(n)],
        "sample_index": [i % cfg.samples_per_prompt for i in range(n)],
        "failed": [i in failing for i in range(n)],
    }
    if any(c.block is not None for c in contexts):
        meta.update({name: [getattr(c, name) for c in contexts] for name in TRACE_COLUMNS})
        meta["previous_holder"] = [c.previous for c in contexts]
        meta["slot_reused"] = [c.slot_reused for c in contexts]
        meta["shared_with"] = [list(c.shared_with) for c in contexts]
    if result.guard is not None:
        meta["guard_checks"] = [result.guard_checks.get(rid, []) for rid in result.request_ids]
    batch = StepBatch.from_ragged(
        logp_rollout=[r.logprobs for r in rollouts], logp_train=reference, request_ids=list(result.request_ids),
        tokens=[np.asarray(r.token_ids, dtype=np.int64) for r in rollouts],
        prompt_tokens=[np.asarray(p, dtype=np.int64) for p in prompts], meta=meta,
    )
    context = {
        "model": cfg.model, "model_type": model_type_at(cfg.model), "framework": "stress", "source": "rlcheck stress", "logp_train": JUDGES[result.judge],
        **vllm_record(engine_config(cfg), n=1, settings=result.settings),  # greedy: logprobs at T = 1
        "reference": {"dtype": cfg.reference_dtype, "device": cfg.reference_device} if result.judge == "reference" else None,
        "stress": {"judge": result.judge, "audits": list(cfg.audits), "fault": cfg.fault, "boundary": cfg.fault_boundary, "layer": cfg.layer, "threshold": result.threshold,
                   "num_blocks": result.num_blocks, "max_num_seqs": cfg.max_num_seqs,
                   "kv_cache_bytes": cfg.kv_cache_bytes, "trace": result.trace, "engine_settings": result.settings},
    }
    if result.guard is not None:
        context["guard"] = guard_dict(result.guard, max_violations=20)
    reason = f"stress: {len(failing)} of {n} requests over max |d| {result.threshold:g}"
    write_dump(out, batch, step=0, reason=reason, context=context, divergence_tau=result.threshold)
    if result.guard is not None:
        result.guard.write(out)  # after the dump: write_dump replaces the folder whole
    result = replace(result, dump_dir=str(out))
    (out / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=1))
    return result


def render_stress(result: StressResult, console: Any, top: int = 20) -> None:
    """Header, the first `top` failing requests (arrival order) with their context, and the verdict."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    r, cfg = result, result.config
    fault = cfg.fault + (f" (boundary {cfg.fault_boundary})" if cfg.fault_boundary else "") + (
        f" (layer {cfg.layer})" if cfg.layer is not None else "")
    console.print(
        f"{escape(cfg.model)}: {r.num_requests} requests ({cfg.samples_per_prompt} per prompt, {cfg.max_tokens} tokens, "
        f"greedy, {cfg.dtype}); max_num_seqs {cfg.max_num_seqs}, cache {show_value('kv_cache_bytes', cfg.kv_cache_bytes)} = "
        f"{r.num_blocks} blocks; fault: {fault}; {escape(r.trace)}")
    secs = r.seconds
    console.print(f"start {secs.get('build', 0):.1f} s ({'reference, ' if cfg.reference else ''}engine) + generate {secs.get('generate', 0):.1f} s "
                  + (f"+ audits {secs['audits']:.1f} s " if "audits" in secs else "")
                  + f"+ replay {secs.get('score', 0):.1f} s: {r.requests_per_second:.1f} requests/s")
    failing = r.failing
    if failing:
        t = Table(title=f"failing requests (first {min(top, len(failing))} of {len(failing)}, arrival order)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("request", "arrival", "max |d|", "1st div", "step", "batch", "block (used)", "held before by",
                    "shared with", *(("guard",) if r.guard is not None else ())):
            t.add_column(col, overflow="fold")
        for i in failing[:top]:
            t.add_row(*(escape(cell) for cell in _cells(r, i)))
        console.print(t)
        console.print("step: engine step of the first prefill (batch: requests in it); block: the state block vLLM "
                      "assigned (and the one the layers used, where it differs); shared with: live requests on the "
                      "same block in the same step")
    wave = r.first_wave
    wave_line = "" if wave is None else f"; first wave (never-used slots): {wave[1]} of {wave[0]} fail"
    against = {"reference": "the reference", "decode-prefill": "their fresh prefill (engine only)"}.get(r.judge)
    if against is None:
        console.print("no per-request judge: --no-reference without --audit decode-prefill")
    elif failing:
        console.print(f"[bold red]FAIL[/]: {len(failing)} of {r.num_requests} requests over max |d| {r.threshold:g} "
                      f"vs {against}; first at arrival {r.first_failing_index}{wave_line}")
    else:
        console.print(f"[green]OK[/]: all {r.num_requests} requests within max |d| {r.threshold:g} of {against}"
                      f"{wave_line}")
    if r.audits:
        from rlcheck.forensics.audits.report import render_audits

        render_audits(r, console, top)
    if r.guard is not None:
        _render_guard(r, console, top)
    if r.dump_dir:
        console.print(f"dump: {escape(r.dump_dir)} (rlcheck diagnose {escape(r.dump_dir)})")


def _render_guard(r: StressResult, console: Any, top: int) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from rlcheck.core.run.guard_record import INVARIANT

    s, violations = r.guard.summary, r.guard.violations
    skipped = f", {s['skipped_steps']} engine steps it could not trace" if s.get("skipped_steps") else ""
    if s["error"]:  # a guard that died checked nothing from there on: never an OK
        console.print(f"[bold yellow]engine guard: STOPPED[/] after {s['num_steps']} engine steps{skipped}: "
                      f"{escape(s['error'])}; the invariants were not checked from there on")
    elif not violations:
        console.print(f"[green]engine guard: OK[/]: no invariant broken over {s['num_steps']} engine steps{skipped}")
    if not violations:
        return
    t = Table(title=f"engine guard: {len(violations)} violations (first {min(top, len(violations))}, step order)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("request", "engine step", "invariant", "slot", "what"):
        t.add_column(col, overflow="fold")
    for v in violations[:top]:
        t.add_row(escape(v.request_id), str(v.step), f"{v.invariant} {v.check}", "-" if v.slot is None else str(v.slot),
                  escape(v.message.split(": ", 1)[-1]))
    console.print(t)
    per = "; ".join(f"{INVARIANT[c]} {c}: {len(ids)} requests" for c, ids in s["request_ids"].items())
    console.print(f"[bold red]engine guard: FAIL[/]: {per}, over {s['num_steps']} engine steps "
                  "(from the engine run alone, before any replay)")


def _cells(r: StressResult, i: int) -> tuple[str, ...]:
    c = r.contexts[i]
    block = "-" if c.block is None else str(c.block) + ("" if c.block_used == c.block else f" ({c.block_used})")
    shared = ", ".join(c.shared_with[:4]) + (f" +{len(c.shared_with) - 4}" if len(c.shared_with) > 4 else "")
    first = r.first_divergence[i]
    from rlcheck.core.run.guard_record import INVARIANT

    checks = [] if r.guard is None else r.guard_checks.get(r.request_ids[i], [])
    guard = () if r.guard is None else (" ".join(INVARIANT[c] for c in checks) or "-",)
    return (r.request_ids[i], str(c.arrival), f"{r.max_abs_diff[i]:.3g}", "-" if first is None else str(first),
            "-" if c.first_step is None else str(c.first_step), "-" if c.batch_size is None else str(c.batch_size),
            block, c.previous or "-", shared or "-", *guard)


def write_sweep(result: SweepResult, out_dir: str | Path) -> tuple[Path, Path | None]:
    """sweep.json (the table) and sweep.png (the plot; None when matplotlib is missing) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / SWEEP_FILE
    try:
        png: Path | None = plot_sweep(result, out / PLOT_FILE)
    except ImportError:
        png = None
    table.write_text(json.dumps({**result.to_dict(), "plot": None if png is None else str(png)}, indent=1))
    return table, png


def plot_sweep(result: SweepResult, path: Path) -> Path:
    """One panel per knob: failing fraction (bars) and first failing arrival index (dots) per value;
    with the batch-invariance audit a second row: the fraction of requests that differ between its
    runs (bars) and max |d| before the first differing token (dots, log scale)."""
    from matplotlib.figure import Figure

    knobs = list(dict.fromkeys(p.knob for p in result.points))
    invariance = any(p.requests_differing is not None for p in result.points)
    fig = Figure(figsize=(max(6.0, 4.5 * len(knobs)), 3.6 * (1 + invariance)), layout="constrained")
    axes = fig.subplots(1 + invariance, len(knobs), squeeze=False)
    for col, knob in enumerate(knobs):
        pts = [p for p in result.points if p.knob == knob]
        _failing_panel(axes[0][col], knob, pts)
        if invariance:
            _invariance_panel(axes[1][col], knob, pts)
    b = result.base
    fig.suptitle(f"{Path(b.model).name}: fault {b.fault}" + (f" (boundary {b.boundary})" if b.boundary else "")
                 + f", {b.num_requests} requests, {b.max_tokens} tokens, {b.dtype}", fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def _knob_axis(ax: Any, knob: str, pts: list[Any]) -> range:
    """Ticks at the knob's values, with each value's state blocks when they differ (else in the label)."""
    xs = range(len(pts))
    blocks = {p.num_blocks for p in pts}
    each = len(blocks) > 1
    ax.set_xticks(list(xs), [show_value(knob, p.value) + (f"\n{p.num_blocks} blocks" if each and p.num_blocks else "")
                             for p in pts], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel(knob + ("" if each or None in blocks else f" ({blocks.pop()} blocks)"))
    return xs


def _failing_panel(ax: Any, knob: str, pts: list[Any]) -> None:
    from matplotlib.ticker import MaxNLocator

    xs = _knob_axis(ax, knob, pts)
    bars = ax.bar(xs, [p.failing_fraction for p in pts], color="tab:red", alpha=0.7)
    ax.bar_label(bars, [f"{p.num_failing}/{p.num_requests}" for p in pts], fontsize=8)
    ax.set_ylabel("failing fraction (bars)")
    right = ax.twinx()
    firsts = [(x, p.first_failing_index) for x, p in zip(xs, pts, strict=True) if p.first_failing_index is not None]
    right.plot([x for x, _ in firsts], [f for _, f in firsts], "o", color="black")
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylim(bottom=0, top=max([f for _, f in firsts] + [1]) * 1.15)
    right.set_ylabel("first failing request (arrival index, dots)")


def _invariance_panel(ax: Any, knob: str, pts: list[Any]) -> None:
    xs = _knob_axis(ax, knob, pts)
    bars = ax.bar(xs, [(p.requests_differing or 0) / max(p.num_requests, 1) for p in pts], color="tab:blue", alpha=0.7)
    ax.bar_label(bars, [f"{p.requests_differing}/{p.num_requests}" for p in pts], fontsize=8)
    ax.set_ylabel("requests differing between runs (bars)")
    right = ax.twinx()
    worst = [(x, p.invariance_max_abs_diff) for x, p in zip(xs, pts, strict=True) if p.invariance_max_abs_diff]
    right.plot([x for x, _ in worst], [w for _, w in worst], "o", color="black")
    if worst:
        right.set_yscale("log")
    right.set_ylabel("max |d| before the first difference (dots)")


def render_sweep(result: SweepResult, console: Any) -> None:
    """The table: one row per knob value."""
    from rich import box
    from rich.table import Table

    t = Table(title="one knob at a time, the others at the base", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    audited = [name for name, attr in (("dp fail", "decode_prefill_failing"), ("differ", "requests_differing"),
                                       ("outputs", "distinct_outputs"), ("max |d| inv", "invariance_max_abs_diff"))
               if any(getattr(p, attr) is not None for p in result.points)]
    for col in ("knob", "value", "blocks", "reqs", "fail", "frac", "1st fail", "wave", *audited, "s"):
        t.add_column(col, no_wrap=True)
    for i, p in enumerate(result.points):
        knob = p.knob if i == 0 or result.points[i - 1].knob != p.knob else ""
        wave = "-" if p.first_wave is None else f"{p.first_wave_failing}/{p.first_wave}"
        first = "-" if p.first_failing_index is None else str(p.first_failing_index)
        audit_cells = {"dp fail": str(p.decode_prefill_failing), "differ": str(p.requests_differing),
                       "outputs": str(p.distinct_outputs), "max |d| inv": f"{p.invariance_max_abs_diff or 0:.3g}"}
        t.add_row(knob, show_value(p.knob, p.value), str(p.num_blocks or "-"), str(p.num_requests),
                  str(p.num_failing), f"{p.failing_fraction:.1%}", first, wave, *(audit_cells[c] for c in audited),
                  f"{p.seconds:.1f}", style="red" if p.num_failing or p.decode_prefill_failing or p.requests_differing else None)
    console.print(t)
    console.print("1st fail: arrival index of the first failing request; wave: failing / size of the first wave "
                  "(requests given a never-used state slot)" + ("; dp fail: decode-prefill audit failures; differ, "
                  "outputs, max |d| inv: the batch-invariance audit's requests differing, most distinct outputs, max |d| "
                  "before the first differing token" if audited else ""))
