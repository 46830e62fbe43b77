"""`rlcheck repro`: an engine failure from a halted run, a dump or a stress output, confirmed, shrunk
and written up as a standalone reproducer (`rlcheck.forensics.repro`). Exit code 1 when a reproducer
was written, 0 when there is nothing to reproduce (a healthy run, the trainer's side, not
reproducible), 2 on bad input."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import typer

from rlcheck.cli.base import app
from rlcheck.cli.paths import existing_dir, output_dir
from rlcheck.forensics.repro.config import ReproConfig
from rlcheck.forensics.repro.files import RESULT_FILE
from rlcheck.forensics.repro.shrink import SHRINK_AXES

ENGINE_LOG = "engine.log"


@app.command()
def repro(
    path: Path = typer.Argument(..., help="A run directory (its newest dump), a dump (RUN/dumps/step_N) or a "
                                          "`rlcheck stress --out` directory."),
    out: Path = typer.Option(None, help="Where repro.py, inputs.json, expected.json and REPORT.md go "
                                        "(default: runs/repro-<time>)."),
    model: Path = typer.Option(None, "--model", help="The model folder (default: the dump's context.model)."),
    confirmations: int = typer.Option(ReproConfig.confirmations, "--confirm", min=1,
                                      help="k: the recorded case must fail in k of k fresh engines before it is shrunk."),
    budget: int = typer.Option(ReproConfig.budget, min=0, help="Probes (a fresh engine each) for the shrink and the knob table."),
    axes: str = typer.Option(",".join(SHRINK_AXES), help="What the shrink may take away, comma-separated: "
                                                         + ", ".join(SHRINK_AXES) + "."),
    compiled: bool = typer.Option(True, "--compiled/--no-compiled", help="Also try vLLM's compiled default "
                                                                         "(enforce_eager off; tens of seconds an engine on CPU)."),
    shape: bool = typer.Option(True, "--shape/--no-shape", help="The knob table: one knob changed at a time."),
    evidence: bool = typer.Option(True, "--evidence/--no-evidence", help="The first divergent layer and the "
                                                                         "decode-prefill and batch-invariance audits."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Run the written repro.py (with and without an "
                                                                   "injected fault) and put its output in the report."),
) -> None:
    """Shrink an engine failure to a standalone reproducer: rebuild the engine with the recorded settings,
    resubmit the failing step's requests greedily and compare with the HF reference; confirm it fails k
    of k times, then shrink it (requests, lengths, max_tokens, engine knobs) to a 1-minimal case and write
    repro.py (vLLM, torch and transformers only), inputs.json, expected.json and REPORT.md (an upstream bug
    report draft). vLLM's own output goes to OUT/engine.log."""
    from rlcheck.forensics.repro import repro as run_repro

    existing_dir(path, "PATH")
    if model is not None:
        existing_dir(model, "--model")
    config = ReproConfig(confirmations=confirmations, budget=budget,
                         axes=tuple(a.strip() for a in axes.split(",") if a.strip()), compiled=compiled, shape=shape,
                         evidence=evidence, verify=verify)
    out = output_dir(out or Path("runs") / time.strftime("repro-%Y%m%d-%H%M%S"), "--out", own_marker=RESULT_FILE)
    if (out / RESULT_FILE).is_file():  # an earlier repro's folder: replaced whole
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with _engine_output(out / ENGINE_LOG) as terminal, _progress(terminal) as advance:
        result = run_repro(path, out, model=model, config=config, progress=advance, log=lambda text: print(text, file=sys.stderr))
    typer.echo(f"{result.verdict.replace('_', ' ')}: {result.message}")
    if result.files:
        typer.echo(f"files: {', '.join(result.files)} in {out}")
    raise typer.Exit(result.exit_code)


@contextlib.contextmanager
def _engine_output(path: Path):
    """File descriptor 2 (vLLM's logs, its progress bars, every probe engine's chatter) into `path`
    while the block runs; yields a stream to the real stderr (the progress bar's)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    terminal = os.fdopen(os.dup(saved), "w")
    try:
        yield terminal
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        terminal.close()


@contextlib.contextmanager
def _progress(stream):
    """One progress bar (probes against the budget) that follows the phase; yields the callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.fields[phase]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=Console(file=stream), transient=False) as progress:
        task = progress.add_task("reading the record", total=None, phase="repro")

        def advance(phase: str, done: int, total: int, text: str) -> None:
            progress.update(task, phase=phase, completed=done, total=total, description=text[:120])

        yield advance
