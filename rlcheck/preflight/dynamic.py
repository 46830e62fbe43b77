"""The dynamic preflight: one fixed teacher-forced probe batch, scored by the engine (vLLM's prompt
logprobs, a fresh prefill) and by the trainer side (a plain Hugging Face forward, `rlcheck.engines.hf`, on
the trainer's device: `probe_device`), both at temperature 1; their mean |d| is judged against the dtype's tolerance, the one the loop's sync
check uses (`rlcheck.core.sync_check.PROBE_TOLERANCE`, the coarser of the two sides' dtypes), and max |d|
is reported beside it.

    result = run_preflight(PreflightConfig(model="models/a", engine_model="models/b"))   # static + probe
    result.probe.mean_abs, result.probe.max_abs

The batch: `PROBE_TEXTS` tokenized by the trainer's tokenizer, each followed by the engine's greedy
continuation of `probe_tokens` tokens (tokens the model finds likely: random ids sit in the tail, where a
low-precision kernel's error is largest). What it catches that the static part cannot: two model folders
whose configs agree but whose weights or kernels do not, and a config difference's actual size.
vLLM and transformers are imported only here, when the probe runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import numpy as np

from rlcheck.core.sync_check import PROBE_TOLERANCE, ProbeResult
from rlcheck.errors import ConfigError
from rlcheck.preflight import sides
from rlcheck.preflight.config import PreflightConfig, canonical_dtype
from rlcheck.preflight.findings import Finding, Preflight, worst_first
from rlcheck.preflight.sides import Side, config_dtype, load_side
from rlcheck.preflight.static import resolve_engine_dtype, run_static

PROBE_TEXTS = ("12+7=19. 3*4=", "The cat sat on the", "Once upon a time, there was a", "The sum of 25 and 17 is")
CPU_KV_CACHE_BYTES = 256 << 20
MAX_MODEL_LEN = 512


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def side_dtypes(cfg: PreflightConfig, trainer: Side, engine: Side) -> tuple[str, str]:
    """(trainer dtype, engine dtype) as the probe runs them (the same rule as the static `dtype` check)."""
    e = resolve_engine_dtype(cfg.dtype, canonical_dtype(config_dtype(engine.config) or "float32"))
    return cfg.trainer_dtype or canonical_dtype(config_dtype(trainer.config) or "float32"), e


def open_engine(cfg: PreflightConfig, dtype: str, engine_config: dict[str, Any] | None = None):
    """rlcheck's vLLM engine on the engine model, sized for the probe (256 MiB KV cache on CPU)."""
    import torch

    from rlcheck.engines.vllm import VLLMConfig, VLLMEngine

    kv = cfg.kv_cache_bytes or (None if torch.cuda.is_available() else CPU_KV_CACHE_BYTES)
    positions = int((engine_config or {}).get("max_position_embeddings") or MAX_MODEL_LEN)
    overrides = {"hf_overrides": dict(cfg.engine_overrides)} if cfg.engine_overrides else {}
    return VLLMEngine(VLLMConfig(model=cfg.engine_path, dtype=dtype, engine_id="preflight", kv_cache_bytes=kv,
                                 max_model_len=min(MAX_MODEL_LEN, positions), engine_kwargs=overrides))


def probe_device(cfg: PreflightConfig, cuda: bool | None = None) -> str:
    """Where the probe's trainer side scores: `cfg.trainer_device`, else where a trainer runs (the GPU
    when there is one: a 7B in float32 is 28 GB of host memory on the CPU). `cuda` None: ask torch. A
    CUDA device on a machine without one is a ConfigError naming the setting."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    device = cfg.trainer_device or ("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise ConfigError(f"trainer_device={device!r}, but this machine has no CUDA device: score the probe where "
                          "the trainer runs, or pass trainer_device='cpu' (--trainer-device cpu)")
    return device


def run_probe(cfg: PreflightConfig, trainer: Side, engine_side: Side, engine: Any = None) -> ProbeResult:
    """Score the probe batch on both sides; `engine`: a started `VLLMEngine` on the engine model to use
    (else one is started here, and closed before the trainer side loads)."""
    from transformers.utils import logging as hf_logging

    from rlcheck.engines.fingerprint import greedy_tokens, score_tokens
    from rlcheck.engines.hf import HFScorer, HFScorerConfig

    hf_logging.disable_progress_bar()  # the weight-loading bars would bury the findings

    t_dtype, e_dtype = side_dtypes(cfg, trainer, engine_side)
    device = probe_device(cfg)  # before the engine starts: a device this machine lacks is refused at once
    prompts = [list(trainer.tokenizer.encode(text)) for text in PROBE_TEXTS]
    own = engine is None
    engine = engine or open_engine(cfg, e_dtype, engine_side.config)
    try:
        responses = greedy_tokens(engine.llm, prompts, cfg.probe_tokens)
        scored_engine = score_tokens(engine.llm, prompts, responses)
    finally:
        if own:
            engine.close()
    scorer = HFScorer(HFScorerConfig(model=cfg.model, dtype=t_dtype, device=device))
    scored_trainer = scorer.score(prompts, responses, temperature=1.0)
    d = np.abs(np.concatenate(scored_trainer).astype(np.float64) - np.concatenate(scored_engine).astype(np.float64))
    tolerance = max(PROBE_TOLERANCE.get(t_dtype, PROBE_TOLERANCE["bfloat16"]),
                    PROBE_TOLERANCE.get(e_dtype, PROBE_TOLERANCE["bfloat16"]))
    return ProbeResult(int(d.size), float(d.mean()), float(d.max()), tolerance)


def probe_finding(probe: ProbeResult, dtypes: tuple[str, str]) -> Finding | None:
    """An "error" finding when the probe's mean |d| is past its tolerance, else None."""
    if probe.ok:
        return None
    return Finding(
        "probe", "error", f"HF forward, {dtypes[0]}", f"vLLM prompt logprobs, {dtypes[1]}",
        f"the same {probe.tokens} teacher-forced tokens get different logprobs: mean |d| {probe.mean_abs:.3g}, "
        f"max |d| {probe.max_abs:.3g} nats, past the tolerance {probe.tolerance:g} (mean |d|).",
        "Fix the findings above; with none left, compare the two sides' weights and kernels "
        "(rlcheck localize names the first divergent layer of a run's dump).")


def run_preflight(cfg: PreflightConfig, *, probe: bool | None = None, engine: Any = None) -> Preflight:
    """The static checks, then the probe (`probe` None: when vLLM is installed); a critical static
    finding, or no trainer tokenizer, skips the probe (said in `probe_note`)."""
    trainer = load_side("trainer", cfg.model)
    read = load_side("engine", cfg.engine_path) if cfg.engine_path != cfg.model else None  # read once, for both
    result = run_static(cfg, trainer, read)
    engine_side = sides.engine_side(cfg, trainer, read)  # as vLLM runs it: the overrides over its config
    note = _skip_reason(result, trainer, probe)
    if note is not None:
        return dataclasses.replace(result, probe_note=note)
    found = run_probe(cfg, trainer, engine_side, engine)
    extra = probe_finding(found, side_dtypes(cfg, trainer, engine_side))
    findings = worst_first(list(result.findings) + ([extra] if extra else []))
    return dataclasses.replace(result, findings=findings, probe=found)


def _skip_reason(result: Preflight, trainer: Side, probe: bool | None) -> str | None:
    if probe is False:
        return "not run (--no-probe)"
    if probe is None and not has_vllm():
        return "not run: vLLM is not installed (the static checks ran)"
    if any(f.severity == "critical" for f in result.findings):
        return "not run: a critical finding makes the two sides' logprobs incomparable"
    if trainer.tokenizer is None or trainer.config is None:
        return "not run: the trainer's model folder has no loadable config or tokenizer"
    return None
