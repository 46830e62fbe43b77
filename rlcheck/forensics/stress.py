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
hook, so the tool can be shown to find what it claims. With `out_dir` the run is written as a dump
(sequences.parquet with those columns, meta.json) plus stress.json: `rlcheck diagnose OUT` reads it.

`guard=True` runs the engine guard (`rlcheck.engines.guard`, policy "record") during generation: its
violations name the broken invariant, the requests, the engine step and the slot from the engine
run alone, before any replay; they go into stress.json ("guard"), the dump's meta (context.guard),
a per-request `guard_checks` column, and OUT/guard/ (summary, violations, trace).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.errors import ConfigError
from rlcheck.forensics.slots import SlotContext, id_key, slot_context

FAULTS = ("none", "stale-state", "index-wrap")
FP32_THRESHOLD = 1e-3
"""Max |d| (nats) over which a request fails when the engine runs in float32: greedy fp32 vLLM agrees
with the fp32 reference to ~1e-5 over thousands of requests (BENCHMARKS.md), while a stale or
aliased state is off by 0.1 to 20 nats; lower-precision engines use replay's DEFAULT_THRESHOLD."""
Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class StressConfig:
    model: str
    """Local model directory (HF layout); a Mamba or hybrid model for the slot trace."""
    num_requests: int = 2000
    """Requests (sequences) sent to the engine at once."""
    samples_per_prompt: int = 8
    """Each prompt is sent this many times in a row (rollouts per prompt: more requests at once)."""
    max_tokens: int = 8
    """Tokens generated per request (always that many: EOS is ignored)."""
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 16
    """Prompt lengths, drawn uniformly from the seed; prompts are random non-special token ids."""
    max_num_seqs: int = 64
    """vLLM's concurrency limit (sequences per engine step)."""
    kv_cache_bytes: int = 8 << 20
    """vLLM's KV and Mamba state cache budget: the memory lever (8 MiB: ~100 slots of the tiny mamba2)."""
    max_num_batched_tokens: int | None = None
    """Tokens per engine step (None: vLLM's default)."""
    max_model_len: int = 256
    dtype: str = "float32"
    seed: int = 0
    """Seed of the prompts and of the engine."""
    fault: str = "none"
    """An engine fault to inject (FAULTS): proves that stress finds it."""
    boundary: int | None = None
    """index-wrap: blocks at or past it wrap (None: max_num_seqs // 2)."""
    threshold: float | None = None
    """Max |d| over which a request fails (None: FP32_THRESHOLD in float32, replay's default otherwise)."""
    guard: bool = False
    """Run the engine guard during generation (lifecycle invariants, policy "record")."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ConfigError(f"unknown fault {self.fault!r}; choose one of {', '.join(FAULTS)}")
        if self.boundary is not None and (self.fault != "index-wrap" or self.boundary < 1):
            raise ConfigError("boundary is for index-wrap only and must be >= 1")
        positive = ("num_requests", "samples_per_prompt", "max_tokens", "min_prompt_tokens", "max_num_seqs",
                    "kv_cache_bytes", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prompt_tokens < self.min_prompt_tokens:
            raise ConfigError("max_prompt_tokens must be >= min_prompt_tokens")
        if self.max_prompt_tokens + self.max_tokens > self.max_model_len:
            raise ConfigError(f"max_prompt_tokens + max_tokens ({self.max_prompt_tokens + self.max_tokens}) "
                              f"must fit max_model_len ({self.max_model_len})")
        if self.threshold is not None and not self.threshold > 0:
            raise ConfigError(f"threshold must be > 0, got {self.threshold}")

    @property
    def fault_boundary(self) -> int | None:
        if self.fault != "index-wrap":
            return None
        return self.boundary if self.boundary is not None else max(1, self.max_num_seqs // 2)

    @property
    def fail_threshold(self) -> float:
        from rlcheck.forensics.replay import DEFAULT_THRESHOLD

        if self.threshold is not None:
            return self.threshold
        return FP32_THRESHOLD if self.dtype == "float32" else DEFAULT_THRESHOLD


def parse_inject(text: str | None) -> tuple[str, int | None]:
    """`--inject` as (fault, boundary): "stale-state", "index-wrap", "index-wrap=4", "none" or None."""
    name, _, value = (text or "none").strip().partition("=")
    if name not in FAULTS:
        raise ConfigError(f"--inject {text!r}: choose stale-state or index-wrap[=B] (B: the wrap boundary, in blocks)")
    if not value:
        return name, None
    if name != "index-wrap" or not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--inject {text!r}: only index-wrap takes a value, a boundary >= 1 (index-wrap=4)")
    return name, int(value)


@dataclass(frozen=True)
class StressResult:
    config: StressConfig
    request_ids: tuple[str, ...]  # vLLM's request ids, arrival order
    max_abs_diff: tuple[float, ...]  # per request, vs the reference (inf: non-finite)
    first_divergence: tuple[int | None, ...]  # first response token over the threshold
    contexts: tuple[SlotContext, ...]
    fault_affected: dict[str, str]  # the injected fault's own account of whom it touched
    num_blocks: int | None  # blocks in the engine's cache (state slots)
    num_steps: int | None  # engine steps traced
    trace: str  # "slot trace", or why there is none
    seconds: dict[str, float] = field(default_factory=dict)  # build, generate, score
    dump_dir: str | None = None
    guard: Any = None  # the engine guard's `GuardOutput` (summary, violations, trace) with cfg.guard

    @cached_property
    def guard_checks(self) -> dict[str, list[str]]:
        """Request id -> the guard checks it broke (empty without a guard)."""
        out: dict[str, list[str]] = {}
        for v in self.guard.violations if self.guard is not None else ():
            out.setdefault(v.request_id, []).append(v.check)
        return out

    @property
    def threshold(self) -> float:
        return self.config.fail_threshold

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @cached_property
    def failing(self) -> list[int]:
        """Arrival indices of the failing requests."""
        return [i for i, m in enumerate(self.max_abs_diff) if m > self.threshold]

    @property
    def failing_request_ids(self) -> list[str]:
        return [self.request_ids[i] for i in self.failing]

    @property
    def failing_fraction(self) -> float:
        return len(self.failing) / max(self.num_requests, 1)

    @property
    def first_failing_index(self) -> int | None:
        return self.failing[0] if self.failing else None

    @property
    def first_wave(self) -> tuple[int, int] | None:
        """(requests that got a never-used slot, how many of them fail); None without a trace."""
        fresh = [c.arrival for c in self.contexts if c.slot_reused is False]
        if not fresh:
            return None
        return len(fresh), sum(self.max_abs_diff[i] > self.threshold for i in fresh)

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / max(sum(self.seconds.values()), 1e-9)

    def to_dict(self) -> dict[str, Any]:
        from rlcheck.core.run.journal import to_jsonable
        from rlcheck.forensics.stress_report import guard_dict

        wave = self.first_wave
        failing = [{"request_id": self.request_ids[i], "max_abs_diff": self.max_abs_diff[i],
                    "first_divergence": self.first_divergence[i], "slot_reused": self.contexts[i].slot_reused,
                    "guard_checks": self.guard_checks.get(self.request_ids[i], []),
                    **asdict(self.contexts[i])} for i in self.failing]
        return to_jsonable({
            "num_requests": self.num_requests, "failing_request_ids": self.failing_request_ids,
            "num_failing": len(self.failing), "failing_fraction": self.failing_fraction,
            "first_failing_index": self.first_failing_index, "threshold": self.threshold,
            "first_wave": None if wave is None else {"num_requests": wave[0], "num_failing": wave[1]},
            "fault": {"name": self.config.fault, "boundary": self.config.fault_boundary,
                      "affected_request_ids": sorted(self.fault_affected, key=id_key)},
            "engine": {"num_blocks": self.num_blocks, "num_steps": self.num_steps, "trace": self.trace},
            "seconds": self.seconds, "requests_per_second": self.requests_per_second,
            "config": asdict(self.config), "dump_dir": self.dump_dir, "failing": failing,
            "guard": None if self.guard is None else guard_dict(self.guard),
        })


def run_stress(cfg: StressConfig, out_dir: str | Path | None = None, *, progress: Progress | None = None,
               scorer: Any = None) -> StressResult:
    """Generate, trace, replay and judge (see the module docstring). `scorer`: an HFScorer of
    `cfg.model` already loaded (a sweep shares one). `progress(phase, done, total)` as it goes."""
    from rlcheck.forensics.ranking import compare
    from rlcheck.forensics.replay import load_scorer, resolve_model, score

    t0 = time.perf_counter()
    scorer = scorer or load_scorer(resolve_model({}, cfg.model))
    prompts = make_prompts(cfg, _allowed_ids(cfg.model, scorer))
    rollouts, fields = _generate(cfg, prompts, progress, t0)
    t1 = time.perf_counter()
    responses = [list(r.token_ids) for r in rollouts]
    reference = score(scorer, prompts, responses, 1.0, True,  # greedy logprobs are untempered: T = 1
                      None if progress is None else lambda d, t: progress("replaying (tokens)", d, t))
    records = compare(fields["request_ids"], reference, [r.logprobs for r in rollouts], tau=cfg.fail_threshold)
    fields["seconds"]["score"] = time.perf_counter() - t1
    result = StressResult(config=cfg, max_abs_diff=tuple(r.score for r in records),
                          first_divergence=tuple(r.first_divergence for r in records), **fields)
    if out_dir is not None:
        from rlcheck.forensics.stress_report import write_stress

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
    """Token ids a prompt may hold: the model's vocabulary without its special tokens."""
    from rlcheck.forensics.replay import vocab_size

    special: set[int] = set()
    try:
        from transformers import AutoTokenizer

        special = set(AutoTokenizer.from_pretrained(model).all_special_ids)
    except (OSError, ValueError, KeyError):
        pass
    ids = np.setdiff1d(np.arange(vocab_size(scorer.model)), np.fromiter(special, dtype=np.int64))
    return ids


def _generate(cfg: StressConfig, prompts: list[list[int]], progress: Progress | None,
              t0: float) -> tuple[list[Any], dict[str, Any]]:
    """One greedy vLLM pass over every prompt at once, with the slot trace (and the fault) on: the
    rollouts, and the StressResult fields that come from the engine."""
    from rlcheck.engines import vllm_faults
    from rlcheck.engines.guard import GuardConfig
    from rlcheck.engines.vllm import VLLMConfig, VLLMEngine

    ecfg = VLLMConfig(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, engine_id="stress", greedy=True,
                      max_tokens=cfg.max_tokens, sampling={"ignore_eos": True}, max_model_len=cfg.max_model_len,
                      max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      kv_cache_bytes=cfg.kv_cache_bytes,
                      guard=GuardConfig(policy="record", capacity=4096) if cfg.guard else None)
    try:
        engine = VLLMEngine(ecfg)
    except (ValueError, RuntimeError) as exc:  # vLLM's own refusal of the settings (cache too small, ...)
        raise ConfigError(f"vLLM refused the stress settings: {str(exc).splitlines()[0]}") from exc
    try:
        handle, trace = None, "slot trace"
        try:
            handle = vllm_faults.inject(engine, cfg.fault, boundary=cfg.fault_boundary)
        except ConfigError as exc:
            if cfg.fault != "none":
                raise
            trace = f"no slot trace: {exc}"
        t1 = time.perf_counter()
        report = None if progress is None else (lambda d, t: progress("generating (requests)", d, len(prompts)))
        bar = None if report is None else progress_bar(report)
        rollouts = engine.generate(prompts, step=0, use_tqdm=bar or False)
        fields: dict[str, Any] = {
            "request_ids": tuple(r.vllm_request_id for r in rollouts), "trace": trace, "fault_affected": {},
            "num_blocks": engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks, "num_steps": None,
            "seconds": {"build": t1 - t0, "generate": time.perf_counter() - t1},
        }
        fields["contexts"] = tuple(SlotContext(i) for i in range(len(rollouts)))
        if handle is not None:
            handle.remove()
            if len(handle.events) >= handle.max_events:
                fields["trace"] = f"slot trace, cut at {handle.max_events} events"
            fields.update(contexts=tuple(slot_context(handle.events, fields["request_ids"])),
                          fault_affected=handle.affected_external(), num_steps=handle.step)
        if engine.guard is not None:
            fields["guard"] = engine.guard.output()
        return rollouts, fields
    finally:
        engine.close()
        gc.collect()


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
