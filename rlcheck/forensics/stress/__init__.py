"""`rlcheck stress --model DIR`: deterministic reproduction of engine faults that only show under load.

    result = run_stress(StressConfig(model="runs/models/hybrid", num_requests=2000), out_dir="runs/stress")
    result.failing_request_ids    # vLLM request ids whose logprobs the HF reference contradicts
    result.contexts[i]            # arrival, scheduler step, state block, previous holder, sharers

What it does, after background/ in the design notes (how vLLM's two silent Mamba bugs were found):
vLLM decodes greedily (temperature 0: the same seed gives the same tokens, ids and schedule), under
memory pressure (a small `kv_cache_bytes`: few state slots) and high concurrency (thousands of
requests, each prompt repeated `samples_per_prompt` times: greedy draws one sample per request);
every output is then replayed through the independent HF reference (`rlcheck.forensics.replay`)
and a request fails when its max |logp_reference - logp_engine| exceeds `threshold`.

Scheduler context, where vLLM 0.32 exposes it (a Mamba model, in-process engine): the slot trace of
`rlcheck.engines.vllm_faults` ("none" traces without changing anything) gives, per request, the
engine step of its first prefill (its batch), the state block it was assigned and the one its layers
used, the request that held that block before it, and the live requests that used the same block in
the same step. `fault` injects "stale-state" or "index-wrap" (with its `boundary`) through the same
hook, or "perturb-layer" (with its `layer`: that decoder layer's output projection x 1.01 inside
vLLM, `rlcheck.engines.vllm_perturb`) beside it, so the tool can be shown to find what it claims. With `out_dir` the run is written as a dump
(sequences.parquet with those columns, meta.json) plus stress.json: `rlcheck diagnose OUT` reads it.

`guard=True` runs the engine guard (`rlcheck.engines.guard`, policy "record") during generation: its
violations name the broken invariant, the requests, the engine step and the slot from the engine
run alone, before any replay; they go into stress.json ("guard"), the dump's meta (context.guard),
a per-request `guard_checks` column, and OUT/guard/ (summary, violations, trace).

The settings live in `rlcheck.forensics.stress.config`, the result in `rlcheck.forensics.stress.results`,
its files and console table in `rlcheck.forensics.stress.report`; this module runs the engine and the replay.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.errors import ConfigError
from rlcheck.forensics.slots import SlotContext, slot_context
from rlcheck.forensics.stress.config import (
    FAULTS,
    FP32_THRESHOLD,
    SLOT_FAULTS,
    Progress,
    StressConfig,
    check_kv_budget,
    check_prefill_limit,
    parse_inject,
)
from rlcheck.forensics.stress.results import StressResult

__all__ = ["FAULTS", "FP32_THRESHOLD", "Progress", "StressConfig", "StressResult", "engine_config", "inject_faults",
           "make_prompts", "parse_inject", "progress_bar", "run_stress", "start_engine"]


def run_stress(cfg: StressConfig, out_dir: str | Path | None = None, *, progress: Progress | None = None,
               scorer: Any = None, serial_cache: dict | None = None) -> StressResult:
    """Generate, trace, audit, replay and judge (see the module docstring). `scorer`: an HFScorer of
    `cfg.model` already loaded (a sweep shares one); `serial_cache`: batch-invariance's serial runs,
    shared by a sweep (`rlcheck.forensics.stress.audits.serial_run`). `progress(phase, done, total)`."""
    from rlcheck.forensics.replay import load_scorer, resolve_model, score
    from rlcheck.forensics.replay.ranking import compare
    from rlcheck.forensics.stress.audits import batch_invariance

    t0 = time.perf_counter()
    if cfg.reference:
        scorer = scorer or load_scorer(resolve_model({}, cfg.model))
    prompts = make_prompts(cfg, _allowed_ids(cfg.model, scorer if cfg.reference else None))
    rollouts, fields, audited = _generate(cfg, prompts, progress, t0)
    if audited.shuffled is not None:
        t = time.perf_counter()
        serial = serial_run(cfg, prompts, progress, serial_cache)
        fields["seconds"]["audits"] += time.perf_counter() - t
        fields["audits"]["batch_invariance"] = batch_invariance(
            cfg, fields["request_ids"], rollouts, audited.shuffled, serial, audited.shuffled_seconds + time.perf_counter() - t)
    t1 = time.perf_counter()
    reference, judge = audited.prefill, "decode-prefill" if audited.prefill is not None else "none"
    if cfg.reference:
        responses = [list(r.token_ids) for r in rollouts]
        reference, judge = score(scorer, prompts, responses, 1.0, True,  # greedy logprobs are untempered: T = 1
                                 None if progress is None else lambda d, t: progress("replaying (tokens)", d, t)), "reference"
        fields["seconds"]["score"] = time.perf_counter() - t1
    if reference is not None:
        records = compare(fields["request_ids"], reference, [r.logprobs for r in rollouts], tau=cfg.fail_threshold)
        fields.update(max_abs_diff=tuple(r.score for r in records),
                      first_divergence=tuple(r.first_divergence for r in records))
    else:
        fields.update(max_abs_diff=(math.nan,) * len(rollouts), first_divergence=(None,) * len(rollouts))
    result = StressResult(config=cfg, judge=judge, **fields)
    if out_dir is not None:
        from rlcheck.forensics.stress.report import write_stress

        result = write_stress(Path(out_dir), result, prompts, rollouts, reference)
    return result


def make_prompts(cfg: StressConfig, allowed: np.ndarray) -> list[list[int]]:
    """num_requests prompts, each of the ceil(num_requests / samples_per_prompt) distinct ones
    repeated samples_per_prompt times in a row; from `cfg.seed` alone."""
    rng = np.random.default_rng(cfg.seed)
    num_prompts = -(-cfg.num_requests // cfg.samples_per_prompt)
    lens = rng.integers(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1, num_prompts)
    distinct = [allowed[rng.integers(0, allowed.size, n)].tolist() for n in lens]
    return [distinct[i // cfg.samples_per_prompt] for i in range(cfg.num_requests)]


def _allowed_ids(model: str, scorer: Any) -> np.ndarray:
    """Token ids a prompt may hold: the model's vocabulary (the reference's, or the config's without
    one) without its special tokens."""
    from transformers import AutoConfig

    from rlcheck.forensics.replay import vocab_size

    special: set[int] = set()
    try:
        from transformers import AutoTokenizer

        special = set(AutoTokenizer.from_pretrained(model).all_special_ids)
    except (OSError, ValueError, KeyError):
        pass
    size = vocab_size(scorer.model) if scorer is not None else int(AutoConfig.from_pretrained(model).get_text_config().vocab_size)
    ids = np.setdiff1d(np.arange(size), np.fromiter(special, dtype=np.int64))
    return ids


def engine_config(cfg: StressConfig):
    """The `VLLMConfig` of a stress run: greedy, EOS ignored, the memory and concurrency knobs of `cfg`,
    hookable (the slot trace, the faults and the guard hook vLLM's V1 runner: `VLLMConfig.hookable`)."""
    from rlcheck.engines.guard import GuardConfig
    from rlcheck.engines.vllm import VLLMConfig

    return VLLMConfig(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, engine_id="stress", greedy=True,
                      max_tokens=cfg.max_tokens, sampling={"ignore_eos": True}, max_model_len=cfg.max_model_len,
                      max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      kv_cache_bytes=cfg.kv_cache_bytes, hookable=True,
                      guard=GuardConfig(policy="record", capacity=4096) if cfg.guard else None)


def start_engine(cfg: StressConfig):
    """The stress run's engine, started (a cache too small for the model refused first, with the figures;
    vLLM's refusal of the settings as a ConfigError)."""
    from rlcheck.engines.vllm import VLLMEngine

    check_kv_budget(cfg)
    check_prefill_limit(cfg, engine_config(cfg))

    try:
        return VLLMEngine(engine_config(cfg))
    except (ValueError, RuntimeError) as exc:  # vLLM's own refusal of the settings (cache too small, ...)
        raise ConfigError(f"vLLM refused the stress settings: {str(exc).splitlines()[0]}") from exc


def inject_faults(engine: Any, cfg: StressConfig) -> tuple[Any, Any, str]:
    """(slot trace handle or None, perturb-layer handle or None, what the trace is) for `cfg.fault`:
    the slot faults through the trace's own hook; perturb-layer beside a plain trace."""
    from rlcheck.engines import vllm_faults

    slot_fault = cfg.fault if cfg.fault in SLOT_FAULTS else "none"
    handle, trace = None, "slot trace"
    try:
        handle = vllm_faults.inject(engine, slot_fault, boundary=cfg.fault_boundary)
    except ConfigError as exc:
        if slot_fault != "none":
            raise
        trace = f"no slot trace: {exc}"
    perturb = vllm_faults.inject(engine, "perturb-layer", layer=cfg.layer) if cfg.fault == "perturb-layer" else None
    return handle, perturb, trace


def _generate(cfg: StressConfig, prompts: list[list[int]], progress: Progress | None,
              t0: float) -> tuple[list[Any], dict[str, Any], Any]:
    """One greedy vLLM pass over every prompt at once, with the slot trace (and the fault) on, then the
    audits that use the same engine (`rlcheck.forensics.stress.audits.engine_audits`): the rollouts,
    the StressResult fields that come from the engine, and the `EngineAudits`."""
    from rlcheck.engines.vllm_env import effective_settings
    from rlcheck.forensics.stress.audits import engine_audits

    engine = start_engine(cfg)
    try:
        handle, perturb, trace = inject_faults(engine, cfg)
        t1 = time.perf_counter()
        report = None if progress is None else (lambda d, t: progress("generating (requests)", d, len(prompts)))
        bar = None if report is None else progress_bar(report)
        rollouts = engine.generate(prompts, step=0, use_tqdm=bar or False)
        fields: dict[str, Any] = {
            "request_ids": tuple(r.vllm_request_id for r in rollouts), "trace": trace, "fault_affected": {},
            "num_blocks": engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks, "num_steps": None,
            "seconds": {"build": t1 - t0, "generate": time.perf_counter() - t1},
            "settings": effective_settings(engine.llm),
        }
        fields["contexts"] = tuple(SlotContext(i) for i in range(len(rollouts)))
        if handle is not None:
            handle.remove()
            if len(handle.events) >= handle.max_events:
                fields["trace"] = f"slot trace, cut at {handle.max_events} events"
            fields.update(contexts=tuple(slot_context(handle.events, fields["request_ids"])),
                          fault_affected=handle.affected_external(), num_steps=handle.step)
        if perturb is not None:  # every request runs through the perturbed layer (the audits' passes too)
            fields["fault_affected"] = {rid: f"ran through {perturb.target} x {perturb.factor:g}"
                                        for rid in fields["request_ids"]}
        if engine.guard is not None:
            fields["guard"] = engine.guard.output()
        t2 = time.perf_counter()
        audited = engine_audits(engine, cfg, prompts, rollouts, progress)
        fields["audits"] = audited.audits
        fields["seconds"]["audits"] = time.perf_counter() - t2
        if perturb is not None:
            perturb.remove()
        return rollouts, fields, audited
    finally:
        engine.close()
        gc.collect()


def serial_config(cfg: StressConfig) -> StressConfig:
    """The settings of batch-invariance's serial run: max_num_seqs 1, no guard, no audit, and no fault
    but a perturbed layer (a wrong weight is wrong at every concurrency; a state fault stands for one
    that the stress load brings out)."""
    keep = cfg.fault == "perturb-layer"
    return replace(cfg, max_num_seqs=1, fault=cfg.fault if keep else "none", boundary=None,
                   layer=cfg.layer if keep else None, guard=False, audits=())


def serial_run(cfg: StressConfig, prompts: list[list[int]], progress: Progress | None,
               cache: dict[StressConfig, Any] | None = None) -> tuple[list[Any], list[Any]]:
    """Every prompt through an engine of `serial_config(cfg)` (from `cache` when it holds that run)."""
    key = serial_config(cfg)
    if cache is not None and key in cache:
        return cache[key]
    engine = start_engine(key)
    try:
        if key.fault != "none":  # a perturbed layer
            inject_faults(engine, key)
        bar = None if progress is None else progress_bar(
            lambda d, t: progress("audit: max_num_seqs 1 (requests)", d, len(prompts)))
        rollouts = engine.generate(prompts, step=2, use_tqdm=bar or False)
    finally:
        engine.close()
        gc.collect()
    out = ([r.token_ids for r in rollouts], [r.logprobs for r in rollouts])
    if cache is not None:
        cache[key] = out
    return out


def progress_bar(callback: Callable[[int, int], None]) -> type:
    """A tqdm stand-in for `LLM.generate(use_tqdm=...)` that reports finished requests as
    `callback(done, total)`; vLLM also wraps its prompt rendering in it (passed through silently)."""

    class ProgressBar:
        def __init__(self, iterable: Any = None, total: int = 0, **_: Any):
            self.n, self.total, self.postfix, self._start = 0, total, "", time.perf_counter()
            self._iterable = iterable

        def __iter__(self):
            return iter(self._iterable or ())

        @property
        def format_dict(self) -> dict[str, float]:
            return {"elapsed": max(time.perf_counter() - self._start, 1e-9)}

        def update(self, n: int = 1) -> None:
            self.n += n
            callback(self.n, self.total)

        def refresh(self) -> None:
            pass

        def close(self) -> None:
            pass

    return ProgressBar
