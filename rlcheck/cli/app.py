"""The `rlcheck` command line. Each command maps onto the library; `rlcheck --help` lists them.

Every path argument is checked before any work starts (`rlcheck.cli.paths`, which says what may be
written where); an error a user can cause (`RLCheckError`) prints as one `rlcheck: error:` line and
exits 2. No command runs a shell or another program.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import typer
from typer.core import TyperGroup

from rlcheck.cli.paths import existing_dir, model_output, model_source, optional_dir, output_dir, output_file
from rlcheck.errors import RLCheckError
from rlcheck.forensics.replay import DEFAULT_TAU, DEFAULT_THRESHOLD

EXIT_USAGE = 2
"""Exit code of a bad argument or input (click's own usage errors use it too)."""


class _Commands(TyperGroup):
    """The command group: an `RLCheckError` from a command is one `rlcheck: error:` line and exit 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RLCheckError as exc:
            typer.echo(f"rlcheck: error: {exc}", err=True)
            raise typer.Exit(EXIT_USAGE) from None


app = typer.Typer(
    name="rlcheck",
    help="Keeps RL post-training honest: rollout vs trainer logprob mismatch monitoring and forensics.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Commands,
)


def _console():
    from rich.console import Console

    return Console(highlight=False)


@app.command()
def summarize(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    worst: int = typer.Option(5, min=1, help="How many worst steps to list."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Alarms, worst steps and metric ranges of a run."""
    from rlcheck.report.summary import render
    from rlcheck.report.summary import summarize as summarize_run

    summary = summarize_run(existing_dir(run_dir, "RUN_DIR"), worst=worst)
    if as_json:
        typer.echo(json.dumps(summary, indent=1))
    else:
        render(summary, _console())


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    out: Path = typer.Option(None, help="Where the HTML goes [default: RUN_DIR/report.html]."),
    open_page: bool = typer.Option(False, "--open", help="Open the page in the default browser."),
) -> None:
    """One self-contained HTML page (no network): diagnosis, alarms, metrics per step, periodogram,
    |d| histogram, offenders and links to the dumps."""
    from rlcheck.report import write_report

    existing_dir(run_dir, "RUN_DIR")
    path = write_report(run_dir, output_file(out, "--out"))
    typer.echo(f"report: {path}")
    if open_page:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())


@app.command()
def demo(
    run_dir: Path = typer.Option(None, help="Where the run's files go [default: runs/demo-<time>]."),
    steps: int = typer.Option(None, min=1, help="Steps to run [default: 20; with --inject, until the halt, at most 100]."),
    trainer: str = typer.Option("fsdp2", help="Trainer backend: fsdp2, deepspeed (ZeRO-3) or hf (one process)."),
    world_size: int = typer.Option(2, min=1, help="Trainer ranks (Ray actors); hf uses 1."),
    inject: str = typer.Option(None, help="A fault to inject, NAME[=VALUE][@START]: skip-sync-every=K, stale-weights@S, temperature-mismatch=F, off-by-one@S, bf16-noise=X@S, corrupt-seqs=R@S, and in the vLLM engine stale-state, index-wrap=B (see rlcheck.faults)."),
    model: Path = typer.Option(Path("runs/models/hybrid-trained"), help="Tiny model folder, built there if missing: <arch>-trained (hybrid-trained, llama-trained) gets a model trained on the task (a few CPU minutes, once), any other name the random hybrid (e.g. runs/models/hybrid)."),
    seed: int = typer.Option(0, help="Seed of the task, the sampling and the trainer."),
    guard: bool = typer.Option(False, "--guard", help="Run the rollout engine with the engine guard: lifecycle invariant violations become alarms."),
    wandb: bool = typer.Option(True, "--wandb/--no-wandb", help="Also log to W&B (offline unless WANDB_MODE says otherwise)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Monitor a synthetic stream instead of the real loop (no Ray, no vLLM)."),
    period: int = typer.Option(12, min=2, help="--synthetic: inject a spike every PERIOD steps."),
    spike_start: int = typer.Option(60, min=0, help="--synthetic: first step that may spike."),
) -> None:
    """GRPO on a tiny model trained on the task, with vLLM rollouts and an FSDP2/DeepSpeed trainer on Ray, monitored."""
    from rlcheck.report.summary import render, summarize

    console = _console()
    if run_dir is None:
        run_dir = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    output_dir(run_dir, "--run-dir")
    if not synthetic:
        model_source(model, "--model")
    if synthetic:
        from rlcheck.demo.synthetic import run_demo as run_synthetic

        found = run_synthetic(run_dir, steps or 200, period, spike_start, seed,
                              ("jsonl", "wandb") if wandb else ("jsonl",), console)
        render(summarize(run_dir), console)
        _demo_report(run_dir, console)
        if not any(a.kind == "periodic" for a in found["alarms"]):
            raise typer.Exit(1)
        return
    from rlcheck.demo.run import DemoOptions, demo_succeeded, run_demo
    from rlcheck.trainers import BACKENDS

    if trainer not in BACKENDS:
        raise typer.BadParameter(f"{trainer!r} is not one of {', '.join(BACKENDS)}", param_hint="--trainer")
    opts = DemoOptions(run_dir=run_dir, model=model, trainer=trainer, world_size=world_size, steps=steps,
                       inject=inject, wandb=wandb, seed=seed, guard=guard)
    opts.fault  # noqa: B018 - a bad --inject fails here, before Ray starts
    found = run_demo(opts, console)
    render(summarize(run_dir), console)
    _demo_report(run_dir, console)
    if not demo_succeeded(found):
        raise typer.Exit(1)


def _demo_report(run_dir: Path, console) -> None:
    """The demo's last line: where its HTML report is."""
    from rlcheck.report import write_report

    console.print(f"report: {write_report(run_dir)}", markup=False)


@app.command()
def diagnose(
    path: Path = typer.Argument(..., help="A run directory (metrics.jsonl, dumps/) or one dump directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
) -> None:
    """Name the likely cause of a mismatch from its shape, with the evidence and a confidence.
    Exit code 0 when healthy, 1 when a cause was found."""
    from rlcheck.forensics.diagnose import diagnose as run_diagnose
    from rlcheck.forensics.render import render_diagnosis

    result = run_diagnose(existing_dir(path, "PATH"))
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

    existing_dir(dump, "DUMP")
    optional_dir(model, "--model")
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


@app.command("make-model")
def make_model(
    out: Path = typer.Argument(..., help="Folder to write the model into (must not exist or be empty)."),
    arch: str = typer.Option(..., help="llama, mamba2 or hybrid (attention + Mamba2, GraniteMoeHybrid)."),
    seed: int = typer.Option(0, help="Seed of the weight init."),
    dtype: str = typer.Option("float32", help="Weight dtype: float32 or bfloat16."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it holds a model make-model built (nothing else is replaced)."),
) -> None:
    """Build a tiny random-weight model and its BPE tokenizer, offline and deterministically."""
    from rlcheck.modelzoo import build_model, describe

    start = time.perf_counter()
    path = build_model(arch, model_output(out, force), seed=seed, dtype=dtype, force=force)
    info = describe(path)
    typer.echo(
        f"built {info['arch']}: {info['num_params']:,} params, vocab {info['vocab_size']}, "
        f"{info['dtype']}, seed {info['seed']} -> {path} ({time.perf_counter() - start:.1f} s)"
    )


import rlcheck.cli.forensics  # noqa: E402,F401 - registers `stress` and `sweep` on `app`


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
