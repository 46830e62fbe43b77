"""The `rlcheck` command line. Each command maps onto the library; `rlcheck --help` lists them."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import typer

from rlcheck.errors import RLCheckError
from rlcheck.forensics.replay import DEFAULT_TAU, DEFAULT_THRESHOLD
from rlcheck.forensics.stress import FP32_THRESHOLD, StressConfig
from rlcheck.forensics.sweep import SWEEP_REQUESTS

app = typer.Typer(
    name="rlcheck",
    help="Keeps RL post-training honest: rollout vs trainer logprob mismatch monitoring and forensics.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _existing_dir(path: Path, what: str) -> Path:
    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint=what)
    if not path.is_dir():
        raise typer.BadParameter(f"{path} is not a directory", param_hint=what)
    return path


@app.command()
def summarize(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    worst: int = typer.Option(5, min=1, help="How many worst steps to list."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Alarms, worst steps and metric ranges of a run."""
    from rlcheck.summarize import render
    from rlcheck.summarize import summarize as summarize_run

    summary = summarize_run(_existing_dir(run_dir, "RUN_DIR"), worst=worst)
    if as_json:
        typer.echo(json.dumps(summary, indent=1))
    else:
        render(summary, _console())


@app.command()
def demo(
    run_dir: Path = typer.Option(None, help="Where the run's files go [default: runs/demo-<time>]."),
    steps: int = typer.Option(None, min=1, help="Steps to run [default: 20; with --inject, until the halt, at most 100]."),
    trainer: str = typer.Option("fsdp2", help="Trainer backend: fsdp2, deepspeed (ZeRO-3) or hf (one process)."),
    world_size: int = typer.Option(2, min=1, help="Trainer ranks (Ray actors); hf uses 1."),
    inject: str = typer.Option(None, help="A fault to inject, NAME[=VALUE][@START]: skip-sync-every=K, stale-weights@S, temperature-mismatch=F, off-by-one@S, bf16-noise=X@S, corrupt-seqs=R@S, and in the vLLM engine stale-state, index-wrap=B (see rlcheck.faults)."),
    model: Path = typer.Option(Path("runs/models/hybrid"), help="Tiny model folder, built there if missing."),
    seed: int = typer.Option(0, help="Seed of the task, the sampling and the trainer."),
    wandb: bool = typer.Option(True, "--wandb/--no-wandb", help="Also log to W&B (offline unless WANDB_MODE says otherwise)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Monitor a synthetic stream instead of the real loop (no Ray, no vLLM)."),
    period: int = typer.Option(12, min=2, help="--synthetic: inject a spike every PERIOD steps."),
    spike_start: int = typer.Option(60, min=0, help="--synthetic: first step that may spike."),
) -> None:
    """GRPO on a tiny hybrid model with vLLM rollouts and an FSDP2/DeepSpeed trainer on Ray, monitored."""
    from rlcheck.summarize import render, summarize

    console = _console()
    if run_dir is None:
        run_dir = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    if synthetic:
        from rlcheck.demo_synthetic import run_demo as run_synthetic

        found = run_synthetic(run_dir, steps or 200, period, spike_start, seed,
                              ("jsonl", "wandb") if wandb else ("jsonl",), console)
        render(summarize(run_dir), console)
        if not any(a.kind == "periodic" for a in found["alarms"]):
            raise typer.Exit(1)
        return
    from rlcheck.demo import DemoOptions, demo_succeeded, run_demo
    from rlcheck.trainers import BACKENDS

    if trainer not in BACKENDS:
        raise typer.BadParameter(f"{trainer!r} is not one of {', '.join(BACKENDS)}", param_hint="--trainer")
    opts = DemoOptions(run_dir=run_dir, model=model, trainer=trainer, world_size=world_size, steps=steps,
                       inject=inject, wandb=wandb, seed=seed)
    opts.fault  # noqa: B018 - a bad --inject fails here, before Ray starts
    found = run_demo(opts, console)
    render(summarize(run_dir), console)
    if not demo_succeeded(found):
        raise typer.Exit(1)


@app.command()
def diagnose(
    path: Path = typer.Argument(..., help="A run directory (metrics.jsonl, dumps/) or one dump directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
) -> None:
    """Name the likely cause of a mismatch from its shape, with the evidence and a confidence.
    Exit code 0 when healthy, 1 when a cause was found."""
    from rlcheck.forensics.diagnose import diagnose as run_diagnose
    from rlcheck.forensics.render import render_diagnosis

    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint="PATH")
    result = run_diagnose(path)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=1))
    else:
        render_diagnosis(result, _console())
    if not result.healthy:
        raise typer.Exit(1)


@app.command()
def replay(
    dump: Path = typer.Argument(..., help="A dump directory: RUN_DIR/dumps/step_NNNNNN/ (sequences.parquet + meta.json)."),
    model: Path = typer.Option(None, "--model", help="The model the rollouts came from (HF folder); default: the dump's context.model."),
    temperature: float = typer.Option(None, help="Temperature the engine sampled at; default: the dump's, else 1.0."),
    threshold: float = typer.Option(
        DEFAULT_THRESHOLD,
        help="Fail (exit 1) when a request's max |d| vs the engine exceeds this many nats. fp32 engines agree with "
             "the reference to ~1e-5, bf16 ones to ~0.1-0.2; 0.5 (a token probability off by 1.65x) is past noise.",
    ),
    tau: float = typer.Option(DEFAULT_TAU, help="|d| that marks a token as divergent (first divergence)."),
    top: int = typer.Option(None, min=1, help="Requests to show: default 20 in the table, all with --json."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-request records, worst first, as JSON."),
    one_at_a_time: bool = typer.Option(False, "--one-at-a-time", help="Score one sequence per forward pass (slower; the batched path's yardstick)."),
) -> None:
    """Re-score every sequence of a dump with the HF reference and rank the requests by max |d| vs the
    engine. Exit code 0 when all are within --threshold, 1 when one is over, 2 on bad input."""
    from rlcheck.forensics.render import render_replay
    from rlcheck.forensics.replay import replay as run_replay

    if not dump.is_dir():
        raise typer.BadParameter(f"{dump} is not a directory", param_hint="DUMP")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the replay's own bar is enough
    with _progress("replaying") as advance:
        report = run_replay(dump, model, temperature=temperature, threshold=threshold, tau=tau,
                            batch=not one_at_a_time, progress=advance)
    if as_json:
        typer.echo(json.dumps(report.to_json(top), indent=1))
    else:
        render_replay(report, _console(), top=top or 20)
    if report.failed:
        raise typer.Exit(1)


@contextlib.contextmanager
def _progress(what: str):
    """A transient progress bar on stderr; yields `advance(done, total)`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


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
                   batched_tokens: int | None, dtype: str, seed: int, inject: str | None, threshold: float | None):
    from rlcheck.forensics.stress import StressConfig, parse_inject
    from rlcheck.forensics.sweep import parse_size

    fault, boundary = parse_inject(inject)
    # vLLM logs to stdout at INFO by default: keep stdout for the table or the JSON
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return StressConfig(model=str(_existing_dir(model, "--model")), num_requests=requests, samples_per_prompt=samples,
                        max_tokens=max_tokens, max_num_seqs=max_num_seqs, kv_cache_bytes=parse_size(kv_cache),
                        max_num_batched_tokens=batched_tokens, dtype=dtype, seed=seed, fault=fault,
                        boundary=boundary, threshold=threshold)


_MODEL = typer.Option(..., "--model", help="The model to stress (HF folder; Mamba2 or hybrid for the slot trace).")
_REQUESTS = typer.Option(StressConfig.num_requests, "--requests", min=1, help="Requests sent to vLLM at once.")
_SAMPLES = typer.Option(StressConfig.samples_per_prompt, "--samples", min=1, help="Samples per prompt (each its own greedy request).")
_MAX_TOKENS = typer.Option(StressConfig.max_tokens, help="Tokens generated per request (EOS ignored).")
_MAX_NUM_SEQS = typer.Option(StressConfig.max_num_seqs, help="vLLM max_num_seqs: sequences per engine step.")
_KV_CACHE = typer.Option(f"{StressConfig.kv_cache_bytes / 2**20:g}MiB", help="vLLM cache budget (KV and Mamba state): bytes, or with KiB/MiB/GiB.")
_BATCHED = typer.Option(None, "--batched-tokens", min=1, help="vLLM max_num_batched_tokens (default: vLLM's).")
_DTYPE = typer.Option(StressConfig.dtype, help="Engine dtype (the reference scores in float32).")
_SEED = typer.Option(StressConfig.seed, help="Seed of the prompts and the engine: same seed, same failing ids.")
_INJECT = typer.Option(None, "--inject", help="An engine fault: stale-state or index-wrap[=B] (B: wrap boundary in blocks, default max_num_seqs/2).")
_THRESHOLD = typer.Option(None, help=f"Max |d| (nats) over which a request fails (default: {FP32_THRESHOLD:g} for float32, "
                                     f"{DEFAULT_THRESHOLD:g} otherwise).")


@app.command()
def stress(
    model: Path = _MODEL, requests: int = _REQUESTS, samples: int = _SAMPLES, max_tokens: int = _MAX_TOKENS,
    max_num_seqs: int = _MAX_NUM_SEQS, kv_cache: str = _KV_CACHE, batched_tokens: int = _BATCHED,
    dtype: str = _DTYPE, seed: int = _SEED, inject: str = _INJECT, threshold: float = _THRESHOLD,
    out: Path = typer.Option(None, help="Where the dump and stress.json go (default: runs/stress-<time>)."),
    top: int = typer.Option(20, min=1, help="Failing requests to list in the table."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (failing_request_ids, num_requests, ...)."),
) -> None:
    """vLLM at temperature 0 under memory pressure and load, every output replayed through the HF
    reference; lists the failing requests with their scheduler context (arrival, step, state block).
    Exit code 0 when none fails, 1 when one does, 2 on bad input. `rlcheck diagnose OUT` names the cause."""
    from rlcheck.forensics.stress import run_stress
    from rlcheck.forensics.stress_report import render_stress

    cfg = _stress_config(model, requests, samples, max_tokens, max_num_seqs, kv_cache, batched_tokens, dtype, seed,
                         inject, threshold)
    out = out or Path("runs") / time.strftime("stress-%Y%m%d-%H%M%S")
    with _phases() as advance:
        result = run_stress(cfg, out, progress=advance)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=1))
    else:
        render_stress(result, _console(), top=top)
    if result.failing:
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
) -> None:
    """Change one knob at a time (cache budget, max sequences, samples per prompt, batched tokens) and
    record, per value, the failures, the first failing request and the failing fraction: a table and a plot."""
    from rlcheck.forensics.sweep import parse_knob, render_sweep, run_sweep, write_sweep

    knobs = [parse_knob(k) for k in knob]
    base = _stress_config(model, requests, samples, max_tokens, max_num_seqs, kv_cache, batched_tokens, dtype, seed,
                          inject, threshold)
    out = out or Path("runs") / time.strftime("sweep-%Y%m%d-%H%M%S")
    with _phases() as advance:
        result = run_sweep(base, knobs, progress=advance)
    table, png = write_sweep(result, out)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "plot": None if png is None else str(png)}, indent=1))
        return
    render_sweep(result, _console())
    typer.echo(f"table: {table}; plot: {png or 'not drawn (pip install matplotlib)'}")


@app.command("make-model")
def make_model(
    out: Path = typer.Argument(..., help="Folder to write the model into (must not exist or be empty)."),
    arch: str = typer.Option(..., help="llama, mamba2 or hybrid (attention + Mamba2, GraniteMoeHybrid)."),
    seed: int = typer.Option(0, help="Seed of the weight init."),
    dtype: str = typer.Option("float32", help="Weight dtype: float32 or bfloat16."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Build a tiny random-weight model and its BPE tokenizer, offline and deterministically."""
    from rlcheck.modelzoo import build_model, describe

    start = time.perf_counter()
    path = build_model(arch, out, seed=seed, dtype=dtype, force=force)
    info = describe(path)
    typer.echo(
        f"built {info['arch']}: {info['num_params']:,} params, vocab {info['vocab_size']}, "
        f"{info['dtype']}, seed {info['seed']} -> {path} ({time.perf_counter() - start:.1f} s)"
    )


def main() -> None:
    """Entry point: rlcheck errors print as one line and exit 2, not as a traceback; an unexpected
    crash exits 3, so that a CI gate tells it from a finding (exit 1)."""
    try:
        app()
    except RLCheckError as exc:
        typer.echo(f"rlcheck: error: {exc}", err=True)
        raise SystemExit(2) from None
    except Exception:  # noqa: BLE001 - reported whole, with its own exit code
        import traceback

        traceback.print_exc()
        typer.echo("rlcheck: internal error (the traceback above); please report it", err=True)
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()
