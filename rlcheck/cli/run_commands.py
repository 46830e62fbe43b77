"""`rlcheck summarize`, `rlcheck report` and `rlcheck demo`: read a run directory (its alarms, worst
steps and metric ranges; one HTML page), or make one (the monitored GRPO demo, real or synthetic).

Every path argument is checked before any work starts (`rlcheck.cli.paths`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from rlcheck.cli.base import app, console
from rlcheck.cli.paths import existing_dir, model_source, output_dir, output_file


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
        render(summary, console())


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
    inject: str = typer.Option(None, help="A fault to inject, NAME[=VALUE][@START]: skip-sync-every=K, stale-weights@S, temperature-mismatch=F, top-p=P, off-by-one@S, off-by-one-early@S, bf16-noise=X@S, corrupt-seqs=R@S, drop-sync=PATTERN@S, in the trainer's inputs retokenize, double-bos, left-pad-positions, stop-token (@S), in the engine's setup stale-prefix-cache@S, rope-mismatch=F, raw-logprobs (attention models: --model runs/models/llama-trained), and in the vLLM engine stale-state, index-wrap=B, stale-buffer, perturb-layer=K (see rlcheck.faults)."),
    model: Path = typer.Option(Path("runs/models/hybrid-trained"), help="Tiny model folder, built there if missing: <arch>-trained (hybrid-trained, llama-trained, moe-trained) gets a model trained on the task (a few CPU minutes, once), any other name the random hybrid (e.g. runs/models/hybrid)."),
    seed: int = typer.Option(0, help="Seed of the task, the sampling and the trainer."),
    guard: bool = typer.Option(False, "--guard", help="Run the rollout engine with the engine guard: lifecycle invariant violations become alarms."),
    quarantine: bool = typer.Option(False, "--quarantine", help="Quarantine the sequences the evidence condemns (out of the step and the loss) instead of halting; past 10%% of a step's sequences it still halts."),
    correction: str = typer.Option(None, help="IS correction in the loss (verl's rollout_is): token (token TIS, cap 2), sequence (sequence TIS, cap 2: the product of the token ratios, which collapses on long episodes) or geometric (exp of the mean log ratio, cap 2)."),
    topk: int = typer.Option(0, "--topk", min=0, help="Top-k distribution metrics (rlcheck/dist/*: top-k overlap, KL estimate): the engine returns K logprobs per position and the trainer scores the same ids; 0: off (20 is the usual K)."),
    audit: bool = typer.Option(False, "--audit", help="The decode-prefill audit: 8 rollouts a step re-scored by a fresh prefill of the rollout engine; a rollout whose decode logprobs differ halts the step (engine-only evidence)."),
    engine_dtype: str = typer.Option("float32", help="vLLM's dtype: float32 (both sides fp32) or bfloat16 (a bf16 engine against the fp32 trainer, the usual RL setup); the monitor judges the run at that precision's floor."),
    weight_sync: str = typer.Option("object-store", help="How the weights reach vLLM after each update: object-store (Ray's) or collective (trainer rank 0 broadcasts them over a gloo group, in 512 MB buckets)."),
    task: str = typer.Option("addition", help="addition (one engine call per rollout) or calculator: 3-turn tool-calling episodes, the tool's reply appended to the engine's own ids (model runs/models/llama-calculator unless --model names another); its faults: retokenized-history, stripped-history, missing-generation-prompt, join-token-mask, tool-tokens-in-loss, turn-logprobs-missing, stale-turn."),
    wandb: bool = typer.Option(True, "--wandb/--no-wandb", help="Also log to W&B (offline unless WANDB_MODE says otherwise)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Monitor a synthetic stream instead of the real loop (no Ray, no vLLM)."),
    period: int = typer.Option(12, min=2, help="--synthetic: inject a spike every PERIOD steps."),
    spike_start: int = typer.Option(60, min=0, help="--synthetic: first step that may spike."),
) -> None:
    """GRPO on a tiny model trained on the task, with vLLM rollouts and an FSDP2/DeepSpeed trainer on Ray, monitored."""
    from rlcheck.report.summary import render, summarize

    screen = console()
    if run_dir is None:
        run_dir = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    output_dir(run_dir, "--run-dir")
    if not synthetic:
        model_source(model, "--model")
    if synthetic:
        from rlcheck.demo.synthetic import run_demo as run_synthetic

        found = run_synthetic(run_dir, steps or 200, period, spike_start, seed,
                              ("jsonl", "wandb") if wandb else ("jsonl",), screen)
        render(summarize(run_dir), screen)
        _demo_report(run_dir, screen)
        if not any(a.kind == "periodic" for a in found["alarms"]):
            raise typer.Exit(1)
        return
    from rlcheck.demo.run import DemoOptions, demo_succeeded, run_demo
    from rlcheck.trainers import BACKENDS

    if trainer not in BACKENDS:
        raise typer.BadParameter(f"{trainer!r} is not one of {', '.join(BACKENDS)}", param_hint="--trainer")
    if correction not in (None, "token", "sequence", "geometric"):
        raise typer.BadParameter(f"{correction!r} is not token, sequence or geometric", param_hint="--correction")
    from rlcheck.loop.presets import TASKS
    from rlcheck.loop.weight_sync import METHODS

    if task not in TASKS:
        raise typer.BadParameter(f"{task!r} is not one of {', '.join(TASKS)}", param_hint="--task")
    if engine_dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"{engine_dtype!r} is not float32 or bfloat16", param_hint="--engine-dtype")

    if weight_sync not in METHODS:
        raise typer.BadParameter(f"{weight_sync!r} is not one of {', '.join(METHODS)}", param_hint="--weight-sync")
    opts = DemoOptions(run_dir=run_dir, model=model, trainer=trainer, world_size=world_size, steps=steps,
                       inject=inject, wandb=wandb, seed=seed, guard=guard, quarantine=quarantine,
                       correction=correction, top_k=topk, audit=audit, weight_sync=weight_sync, task=task,
                       engine_dtype=engine_dtype)
    opts.fault  # noqa: B018 - a bad --inject fails here, before Ray starts
    found = run_demo(opts, screen)
    render(summarize(run_dir), screen)
    _demo_report(run_dir, screen)
    if not demo_succeeded(found):
        raise typer.Exit(1)


def _demo_report(run_dir: Path, screen) -> None:
    """The demo's last line: where its HTML report is."""
    from rlcheck.report import write_report

    screen.print(f"report: {write_report(run_dir)}", markup=False)
