"""`rlcheck preflight`: before a run, compare what the engine and the trainer will do and list every
setting that would make their logprobs differ, each with its fix (`rlcheck.preflight`). Exit code 0 when
nothing is found, 1 when something would make the sides differ, 2 on bad input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from rlcheck.cli.base import app
from rlcheck.cli.paths import existing_dir, optional_dir
from rlcheck.errors import InputError


@app.command()
def preflight(
    model: Path = typer.Option(..., "--model", help="The trainer's model folder (HF layout: config.json, tokenizer)."),
    engine_model: Path = typer.Option(None, "--engine-model", help="The engine's (vLLM's) model folder; default: --model."),
    temperature: float = typer.Option(1.0, help="The engine's sampling temperature (the trainer scores at it)."),
    top_p: float = typer.Option(1.0, "--top-p", help="The engine's top-p (1: off); the trainer scores the full distribution."),
    top_k: int = typer.Option(0, "--top-k", help="The engine's top-k (0 or -1: off)."),
    logprobs_mode: str = typer.Option("processed", "--logprobs-mode", help="vLLM's logprobs_mode: raw or processed "
                                      "(raw_logprobs, processed_logprobs; a *_logits mode is a critical finding)."),
    dtype: str = typer.Option(None, help="The engine's dtype (float32, bfloat16, float16, auto); default: the engine "
                              "model's config dtype."),
    trainer_dtype: str = typer.Option(None, "--trainer-dtype", help="The dtype the trainer computes in; default: "
                                      "the trainer model's config dtype."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="vLLM caches prompt prefixes (its default)."),
    resets: bool = typer.Option(None, "--resets-prefix-cache/--keeps-prefix-cache",
                                help="Whether your weight sync calls reset_prefix_cache() (default: not known, a note)."),
    probe: bool = typer.Option(None, "--probe/--no-probe", help="Run the vLLM vs HF probe batch (default: when vLLM "
                               "is installed)."),
    trainer_device: str = typer.Option(None, "--trainer-device", help="Where the probe's HF forward runs, as the "
                                       "trainer does (cpu, cuda, cuda:N); default: the GPU when there is one."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="The engine's vLLM hf_overrides, as JSON (e.g. "
                                     "'{\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 40000}}'): "
                                     "compared as the engine runs them."),
    as_json: bool = typer.Option(False, "--json", help="Print the findings (key, severity, both values, fix) as JSON."),
) -> None:
    """List every setting on which the engine and the trainer would differ, each with its fix; then score a
    fixed probe batch on both sides (vLLM prompt logprobs vs an HF forward). Exit code 0 when nothing is
    found, 1 when something would make the sides differ, 2 on bad input."""
    from rlcheck.preflight import PreflightConfig, render, run_preflight

    existing_dir(model, "--model")
    optional_dir(engine_model, "--engine-model")
    # vLLM logs to stdout at INFO by default: keep stdout for the findings or the JSON
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cfg = PreflightConfig(model=str(model), engine_model=None if engine_model is None else str(engine_model),
                          temperature=temperature, top_p=top_p, top_k=top_k, logprobs_mode=logprobs_mode, dtype=dtype,
                          trainer_dtype=trainer_dtype, prefix_caching=prefix_caching, resets_prefix_cache=resets,
                          trainer_device=trainer_device, engine_overrides=_overrides(hf_overrides))
    result = run_preflight(cfg, probe=probe)
    typer.echo(json.dumps(result.to_dict(), indent=1) if as_json else render(result))
    if result.differs:
        raise typer.Exit(1)


def _overrides(text: str | None) -> dict | None:
    """--hf-overrides: a JSON object, else a usage error naming the option."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InputError(f"--hf-overrides is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError(f"--hf-overrides must be a JSON object of config fields, got {text!r}")
    return value
