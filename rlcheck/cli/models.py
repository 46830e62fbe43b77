"""`rlcheck make-model OUT --arch ARCH`: a tiny random-weight model and its BPE tokenizer, built
offline and deterministically (`rlcheck.modelzoo`); `--force` replaces only a folder it built."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from rlcheck.cli.base import app
from rlcheck.cli.paths import model_output


@app.command("make-model")
def make_model(
    out: Path = typer.Argument(..., help="Folder to write the model into (must not exist or be empty)."),
    arch: str = typer.Option(..., help="llama, mamba2, hybrid (attention + Mamba2, GraniteMoeHybrid), moe (Qwen3-MoE, 8 experts, top-2) or qwen2 (2 layers)."),
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
