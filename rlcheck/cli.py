"""The `rlcheck` command line. Each command maps onto the library; `rlcheck --help` lists them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from rlcheck.errors import RLCheckError

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
    steps: int = typer.Option(200, min=1, help="Steps to run at most."),
    period: int = typer.Option(12, min=2, help="Inject a spike every PERIOD steps."),
    spike_start: int = typer.Option(60, min=0, help="First step that may spike."),
    seed: int = typer.Option(0, help="Seed of the synthetic stream."),
    wandb: bool = typer.Option(False, "--wandb", help="Also log to W&B (offline unless WANDB_MODE says otherwise)."),
) -> None:
    """Run the monitor over a realistic synthetic stream with a periodic spike and show what it finds."""
    from rlcheck.demo import run_demo
    from rlcheck.summarize import render, summarize

    console = _console()
    if run_dir is None:
        run_dir = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    sinks = ("jsonl", "wandb") if wandb else ("jsonl",)
    found = run_demo(run_dir, steps, period, spike_start, seed, sinks, console)
    render(summarize(run_dir), console)
    if not any(a.kind == "periodic" for a in found["alarms"]):
        raise typer.Exit(1)


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
    """Entry point: rlcheck errors print as one line and exit 2, not as a traceback."""
    try:
        app()
    except RLCheckError as exc:
        typer.echo(f"rlcheck: error: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
