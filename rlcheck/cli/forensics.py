"""`rlcheck stress` and `rlcheck sweep`: vLLM under memory pressure and load, every output replayed
through the HF reference, one run or one knob at a time (`rlcheck.forensics.stress`, `.sweep`); and
`rlcheck localize`: a divergence traced to its first decoder layer (`rlcheck.forensics.localize`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import typer

from rlcheck.cli.base import app, console
from rlcheck.cli.paths import existing_dir, output_dir
from rlcheck.forensics.localize import DEFAULT_TOP as LOCALIZE_TOP
from rlcheck.forensics.localize.compare import TOLERANCES
from rlcheck.forensics.replay import DEFAULT_THRESHOLD
from rlcheck.forensics.stress.config import (
    FP32_THRESHOLD,
    StressConfig,
    parse_audits,
    parse_inject,
    parse_size,
)
from rlcheck.forensics.stress.report import RESULT_FILE as STRESS_FILE
from rlcheck.forensics.stress.report import SWEEP_FILE
from rlcheck.forensics.sweep import SWEEP_REQUESTS


@contextlib.contextmanager
def _phases():
    """One transient progress bar on stderr that follows the current phase; yields `advance(phase, done, total)`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting", total=None)
        yield lambda phase, done, total: progress.update(task, description=phase, completed=done, total=total)


def _stress_config(model: Path, requests: int, samples: int, max_tokens: int, max_num_seqs: int, kv_cache: str,
                   batched_tokens: int | None, dtype: str, seed: int, inject: str | None, threshold: float | None,
                   reference_dtype: str = "float32", device: str = "cpu"):
    fault, value = parse_inject(inject)
    # vLLM logs to stdout at INFO by default: keep stdout for the table or the JSON
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return StressConfig(model=str(existing_dir(model, "--model")), num_requests=requests, samples_per_prompt=samples,
                        max_tokens=max_tokens, max_num_seqs=max_num_seqs, kv_cache_bytes=parse_size(kv_cache),
                        max_num_batched_tokens=batched_tokens, dtype=dtype, seed=seed, fault=fault,
                        boundary=value if fault == "index-wrap" else None,
                        layer=value if fault == "perturb-layer" else None, threshold=threshold,
                        reference_dtype=reference_dtype, reference_device=device)


_MODEL = typer.Option(..., "--model", help="The model to stress (HF folder; Mamba2 or hybrid for the slot trace).")
_REQUESTS = typer.Option(StressConfig.num_requests, "--requests", min=1, help="Requests sent to vLLM at once.")
_SAMPLES = typer.Option(StressConfig.samples_per_prompt, "--samples", min=1, help="Samples per prompt (each its own greedy request).")
_MAX_TOKENS = typer.Option(StressConfig.max_tokens, help="Tokens generated per request (EOS ignored).")
_MAX_NUM_SEQS = typer.Option(StressConfig.max_num_seqs, help="vLLM max_num_seqs: sequences per engine step.")
_KV_CACHE = typer.Option(f"{StressConfig.kv_cache_bytes / 2**20:g}MiB", help="vLLM cache budget (KV and Mamba state): bytes, or with KiB/MiB/GiB.")
_BATCHED = typer.Option(None, "--batched-tokens", min=1, help="vLLM max_num_batched_tokens (default: vLLM's).")
_DTYPE = typer.Option(StressConfig.dtype, help="Engine dtype (the reference scores in float32).")
_SEED = typer.Option(StressConfig.seed, help="Seed of the prompts and the engine: same seed, same failing ids.")
_INJECT = typer.Option(None, "--inject", help="An engine fault: stale-state, index-wrap[=B] (B: wrap boundary in blocks, default "
                                              "max_num_seqs/2), perturb-layer=K (decoder layer K's output projection x 1.01 in vLLM) or "
                                              "stale-buffer (one weight sync leaves the Mamba conv buffers stale).")
_AUDIT = typer.Option(None, "--audit", help="Engine self-audit (repeatable): decode-prefill (every request re-scored by a fresh "
                                            "prefill of the same engine) or batch-invariance (again at max_num_seqs 1 and in "
                                            "shuffled order).")
_NO_REFERENCE = typer.Option(False, "--no-reference", help="Skip the HF reference (engine only, fast); with --audit "
                                                           "decode-prefill the fresh prefill judges each request.")
_THRESHOLD = typer.Option(None, help=f"Max |d| (nats) over which a request fails (default: {FP32_THRESHOLD:g} when engine "
                                     f"and reference run float32, {DEFAULT_THRESHOLD:g} otherwise).")
_REF_DTYPE = typer.Option("float32", "--reference-dtype", help="The HF reference's dtype: float32 (default), bfloat16 or "
                                                               "float16 (half the memory; its tolerance is bfloat16's).")
_DEVICE = typer.Option("cpu", "--device", help="Where the HF reference runs: cpu (default), cuda or cuda:N.")


@app.command()
def stress(
    model: Path = _MODEL, requests: int = _REQUESTS, samples: int = _SAMPLES, max_tokens: int = _MAX_TOKENS,
    max_num_seqs: int = _MAX_NUM_SEQS, kv_cache: str = _KV_CACHE, batched_tokens: int = _BATCHED,
    dtype: str = _DTYPE, seed: int = _SEED, inject: str = _INJECT, threshold: float = _THRESHOLD,
    out: Path = typer.Option(None, help="Where the dump and stress.json go (default: runs/stress-<time>)."),
    top: int = typer.Option(20, min=1, help="Failing requests to list in the table."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (failing_request_ids, num_requests, ...)."),
    guard: bool = typer.Option(False, "--guard", help="Run the engine guard: lifecycle invariants checked at every "
                                                      "engine step, violations named before the replay."),
    audit: list[str] = _AUDIT, no_reference: bool = _NO_REFERENCE, reference_dtype: str = _REF_DTYPE,
    device: str = _DEVICE,
) -> None:
    """vLLM at temperature 0 under memory pressure and load, every output replayed through the HF
    reference; lists the failing requests with their scheduler context (arrival, step, state block),
    with --guard the engine guard's violations (invariant, request, engine step, slot), and with
    --audit the engine checked against itself (decode vs prefill, batch invariance).
    Exit code 0 when none fails, 1 when one does (or the guard or an audit found one, or the guard
    stopped on an error of its own), 2 on bad input.
    `rlcheck diagnose OUT` names the cause."""
    from rlcheck.forensics.stress import run_stress
    from rlcheck.forensics.stress.report import render_stress

    cfg = _stress_config(model, requests, samples, max_tokens, max_num_seqs, kv_cache, batched_tokens, dtype, seed,
                         inject, threshold, reference_dtype, device)
    cfg = replace(cfg, guard=guard, audits=parse_audits(audit), reference=not no_reference)
    out = output_dir(out or Path("runs") / time.strftime("stress-%Y%m%d-%H%M%S"), "--out", own_marker=STRESS_FILE)
    with _phases() as advance:
        result = run_stress(cfg, out, progress=advance)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=1))
    else:
        render_stress(result, console(), top=top)
    guard = result.guard
    if result.failing or result.audit_failed or (guard is not None and (guard.violations or guard.summary["error"])):
        raise typer.Exit(1)


@app.command()
def sweep(
    knob: list[str] = typer.Option(..., "--knob", help="NAME=V1,V2,... (repeatable): kv_cache_bytes, max_num_seqs, samples_per_prompt, max_num_batched_tokens."),
    model: Path = _MODEL, requests: int = typer.Option(SWEEP_REQUESTS, "--requests", min=1, help="Requests per run (per knob value)."),
    samples: int = _SAMPLES, max_tokens: int = _MAX_TOKENS, max_num_seqs: int = _MAX_NUM_SEQS,
    kv_cache: str = _KV_CACHE, batched_tokens: int = _BATCHED, dtype: str = _DTYPE, seed: int = _SEED,
    inject: str = _INJECT, threshold: float = _THRESHOLD,
    out: Path = typer.Option(None, help="Where sweep.json and sweep.png go (default: runs/sweep-<time>)."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON."),
    audit: list[str] = _AUDIT, no_reference: bool = _NO_REFERENCE, reference_dtype: str = _REF_DTYPE,
    device: str = _DEVICE,
) -> None:
    """Change one knob at a time (cache budget, max sequences, samples per prompt, batched tokens) and
    record, per value, the failures, the first failing request and the failing fraction (and with
    --audit, each audit's count of disagreeing requests): a table and a plot."""
    from rlcheck.forensics.stress.report import render_sweep, write_sweep
    from rlcheck.forensics.sweep import parse_knob, run_sweep

    knobs = [parse_knob(k) for k in knob]
    base = _stress_config(model, requests, samples, max_tokens, max_num_seqs, kv_cache, batched_tokens, dtype, seed,
                          inject, threshold, reference_dtype, device)
    base = replace(base, audits=parse_audits(audit), reference=not no_reference)
    out = output_dir(out or Path("runs") / time.strftime("sweep-%Y%m%d-%H%M%S"), "--out", own_marker=SWEEP_FILE)
    with _phases() as advance:
        result = run_sweep(base, knobs, progress=advance)
    table, png = write_sweep(result, out)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "plot": None if png is None else str(png)}, indent=1))
        return
    render_sweep(result, console())
    typer.echo(f"table: {table}; plot: {png or 'not drawn (pip install matplotlib)'}")


@app.command()
def localize(
    path: Path = typer.Argument(..., help="A dump directory, or a `rlcheck stress --out` directory (re-run whole)."),
    model: Path = typer.Option(None, "--model", help="The model (HF folder); default: the dump's context.model."),
    request: list[str] = typer.Option(None, "--request", help="A request id to localize (repeatable); default: the worst --top."),
    top: int = typer.Option(LOCALIZE_TOP, min=1, help="Worst requests to localize (by max |logp_train - logp_rollout|)."),
    tolerance: float = typer.Option(None, help="Relative error over which a layer diverges (default: the looser of the "
                                               "engine's dtype (as the dump records it; the loosest when it does not) and "
                                               "the reference's: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCES.items()) + ")."),
    fault: str = typer.Option(None, "--fault", help="The engine fault to re-inject in a teacher-forced re-run instead of the "
                                                    "dump's (context.fault), e.g. perturb-layer=2; 'none' for none."),
    reference_dtype: str = _REF_DTYPE, device: str = _DEVICE,
    as_json: bool = typer.Option(False, "--json", help="Print the per-request list as JSON (request_id, "
                                                       "first_divergent_layer, layer_type, position, layers, ...)."),
) -> None:
    """Localize a logprob divergence to its first decoder layer: re-run the worst requests through vLLM
    (the dump's engine settings, hooks on every decoder layer) and through the HF reference, and
    compare the hidden states layer by layer, position by position. Writes PATH/localize.json and
    PATH/localize.png (read by `rlcheck diagnose` and `rlcheck report`). Exit code 0 when no layer
    diverges, 1 when one does, 2 on bad input."""
    from transformers.utils import logging as hf_logging

    from rlcheck.engines.reference import ReferenceConfig
    from rlcheck.forensics.localize import localize as run_localize
    from rlcheck.forensics.localize.report import render_localization

    existing_dir(path, "PATH")
    if model is not None:
        existing_dir(model, "--model")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    hf_logging.disable_progress_bar()
    with _phases() as advance:
        result = run_localize(path, model, request_ids=request or None, top=top, tolerance=tolerance, fault=fault,
                              reference=ReferenceConfig(reference_dtype, device), progress=advance)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        render_localization(result.to_dict(), console())
    if result.divergent:
        raise typer.Exit(1)
