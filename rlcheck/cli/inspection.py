"""`rlcheck diagnose` and `rlcheck replay`: a run or a dump after the fact. diagnose names the likely
cause of a mismatch from its shape; replay re-scores a dump with the HF reference and ranks the
requests. Exit code 0 when healthy or within the threshold, 1 on a finding, 2 on bad input.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer

from rlcheck.cli.base import app, console
from rlcheck.cli.paths import existing_dir, optional_dir
from rlcheck.forensics.replay import DEFAULT_TAU, DEFAULT_THRESHOLD


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
        render_diagnosis(result, console())
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
    reference_dtype: str = typer.Option("float32", "--reference-dtype", help="The HF reference's dtype: float32 (default), "
                                                                             "bfloat16 or float16 (half the memory)."),
    device: str = typer.Option("cpu", "--device", help="Where the HF reference runs: cpu (default), cuda or cuda:N."),
) -> None:
    """Re-score every sequence of a dump with the HF reference and rank the requests by max |d| vs the
    engine. Exit code 0 when all are within --threshold, 1 when one is over, 2 on bad input."""
    from rlcheck.engines.reference import ReferenceConfig
    from rlcheck.forensics.render import render_replay
    from rlcheck.forensics.replay import replay as run_replay

    existing_dir(dump, "DUMP")
    optional_dir(model, "--model")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the replay's own bar is enough
    with _progress("replaying") as advance:
        report = run_replay(dump, model, temperature=temperature, threshold=threshold, tau=tau,
                            batch=not one_at_a_time, progress=advance, reference=ReferenceConfig(reference_dtype, device))
    if as_json:
        typer.echo(json.dumps(report.to_json(top), indent=1))
    else:
        render_replay(report, console(), top=top or 20)
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
