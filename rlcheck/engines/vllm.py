"""Rollout engine over `vllm.LLM`, in-process: sampled tokens, their logprobs, and who produced them.

    engine = VLLMEngine(VLLMConfig(model="models/hybrid", dtype="float32", seed=0))
    rollouts = engine.generate(prompt_token_ids, step=3, n=4)    # list[Rollout], prompt-major
    engine.sync_weights(model.state_dict().items(), version=4)    # reload_weights + conv refresh + cache reset

Which logprob comes back, deliberately: `logprobs_mode="processed_logprobs"`, the log-softmax of the
logits after temperature (and after any penalty, top-k or top-p), i.e. the distribution the token
was actually sampled from. A trainer that computes log_softmax(logits / T) matches it exactly as
long as no top-k, top-p, min-p or penalty is set, so `VLLMConfig` refuses those unless
`allow_logit_processing=True` (then the mismatch they cause is real and the monitor will show it).
With "raw_logprobs" (log_softmax of the unscaled logits) the trainer must score at T = 1.

Identity: vLLM numbers requests "0", "1", ... per engine, and a request with n samples runs as child
requests "{i}_{parent}". Every `Rollout` keeps that `vllm_request_id` unchanged and gets a
`request_id` unique across engines and steps: "{engine_id}/s{step}/{vllm_request_id}".

Memory-pressure knobs (for stress reproduction): `kv_cache_bytes` (KV and Mamba state cache budget),
`gpu_memory_utilization`, `max_num_seqs`, `max_num_batched_tokens`, `block_size`. On the CPU backend
set `kv_cache_bytes`: otherwise vLLM reserves gpu_memory_utilization (0.92) of the machine's RAM and
refuses to start when that much is not free. vllm is imported only when an engine is built.

Engine guard: `guard=GuardConfig(...)` (or RLCHECK_BREAK_ON in the environment) installs
`rlcheck.engines.guard` when the engine starts; `take_guard_violations()` hands its new violations
over (with each rollout's `request_id`), `write_guard(dir)` writes its record into a dump.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.engines.guard import GuardConfig
from rlcheck.engines.vllm_env import LOGIT_PROCESSING, build_llm
from rlcheck.errors import ConfigError, InputError

LOGPROB_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass(frozen=True)
class VLLMConfig:
    model: str
    """Path of a local model directory (HF layout)."""
    dtype: str = "float32"
    seed: int = 0
    engine_id: str = "e0"
    """Prefix of every request id this engine hands out; unique per engine in a run."""
    temperature: float = 1.0
    greedy: bool = False
    """Decode at temperature 0 (argmax; vLLM then allows one sample per request): the deterministic
    mode of stress reproduction. `temperature` is ignored and the returned logprobs are those of the
    untempered distribution, log_softmax(logits): score them at T = 1."""
    max_tokens: int = 64
    top_logprobs: int = 0
    """Also return the top-k logprobs of every position (k = this)."""
    logprobs_mode: str = "processed_logprobs"
    allow_logit_processing: bool = False
    """Permit top_k / top_p / min_p / penalties in `sampling` (the trainer does not reproduce them)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Extra `vllm.SamplingParams` fields (stop, top_p, ...)."""
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int | None = None
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Anything else for `vllm.LLM(...)`."""
    guard: GuardConfig | None = None
    """The engine guard (`rlcheck.engines.guard.GuardConfig`), installed when the engine starts; None: off
    (unless RLCHECK_BREAK_ON is set, which installs one with the default config)."""
    hookable: bool = False
    """Build it for an engine fault (`rlcheck.engines.vllm_faults`): eager, vLLM's V1 model runner
    (`vllm_faults.hookable_settings`, said on stderr). A guard implies it."""
    moe_routing: str = "auto"
    """Record each response token's MoE experts (`Rollout.experts`, for `rlcheck.core.moe`): "auto"
    (on for an MoE model where it can be), "on", "off"; `rlcheck.engines.moe_capture.routing_plan`."""

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROB_MODES:
            raise ConfigError(f"logprobs_mode must be one of {LOGPROB_MODES}, got {self.logprobs_mode!r}")
        if not self.temperature > 0 and not self.greedy:
            raise ConfigError(
                f"temperature must be > 0 (got {self.temperature}); greedy decoding has no sampling "
                "distribution to compare: use a small temperature, or greedy=True (logprobs at T = 1)"
            )
        if self.max_tokens < 1 or self.top_logprobs < 0:
            raise ConfigError("max_tokens must be >= 1 and top_logprobs >= 0")
        used = sorted(LOGIT_PROCESSING & set(self.sampling))
        if used and not self.allow_logit_processing:
            raise ConfigError(
                f"sampling sets {used}: the engine's logprobs then differ from what a trainer "
                "computes from log_softmax(logits / T); pass allow_logit_processing=True to do it anyway"
            )
        if not self.engine_id or "/" in self.engine_id:
            raise ConfigError(f"engine_id must be non-empty without '/', got {self.engine_id!r}")
        if self.moe_routing not in ("auto", "on", "off"):
            raise ConfigError(f"moe_routing must be 'auto', 'on' or 'off', got {self.moe_routing!r}")
        if self.guard is not None and not isinstance(self.guard, GuardConfig):
            raise ConfigError(f"guard must be a rlcheck.engines.guard.GuardConfig or None, got {self.guard!r}")


@dataclass(frozen=True)
class Rollout:
    """One sampled sequence."""

    request_id: str  # unique across engines and steps
    vllm_request_id: str  # as the engine's scheduler knew it
    prompt_index: int
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: np.ndarray  # (len(token_ids),) float32, logprob of each sampled token
    top_logprobs: tuple[dict[int, float], ...] | None
    text: str
    finish_reason: str | None
    weight_version: int
    step: int
    experts: np.ndarray | None = None  # (len(token_ids), L, k) int64: the MoE experts of each token, if recorded
    fault_touched: bool = False  # an engine fault injected for a self-test acted on it (`rlcheck.loop.actors`)


class VLLMEngine:
    """See the module docstring."""

    def __init__(self, cfg: VLLMConfig):
        self.cfg = cfg
        self.weight_version = 0
        from rlcheck.engines.moe_capture import engine_routes

        self.llm = build_llm(cfg)
        self.routes = engine_routes(self)  # MoE models: each rollout's experts
        self.guard = None
        if cfg.guard is not None or os.environ.get("RLCHECK_BREAK_ON"):
            from rlcheck.engines.guard import install_guard

            self.guard = install_guard(self, cfg.guard)
            self.guard.rollout_prefix = cfg.engine_id

    def sampling_params(self, n: int, seed: int | None):
        from vllm import SamplingParams

        if self.cfg.greedy and n != 1:
            raise InputError(f"greedy decoding draws one sample per request (vLLM refuses n={n}); repeat the prompt instead")
        return SamplingParams(
            n=n,
            temperature=0.0 if self.cfg.greedy else self.cfg.temperature,
            max_tokens=self.cfg.max_tokens,
            logprobs=self.cfg.top_logprobs,
            seed=seed,
            **({"detokenize": False} if self._decode_here else {}),
            **self.cfg.sampling,
        )

    @property
    def _decode_here(self) -> bool:
        """With top-k logprobs (and no stop strings, which need vLLM's text) the response is decoded
        here, once: vLLM 0.32 would decode every top-k entry of every position (BENCHMARKS.md, "Beyond
        the sampled token")."""
        return bool(self.cfg.top_logprobs) and not {"stop", "detokenize"} & set(self.cfg.sampling)

    def _text(self, c: Any, ids: tuple[int, ...]) -> str:
        """vLLM's text of a completion, or the same from its ids: vLLM holds back a trailing partial
        UTF-8 character, which a whole decode shows as U+FFFD."""
        if not self._decode_here:
            return c.text
        return self.llm.get_tokenizer().decode(list(ids), skip_special_tokens=True).rstrip("\ufffd")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        step: int,
        n: int = 1,
        seed: int | Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[Rollout]:
        """n samples for each prompt (token ids), in prompt-major order. `seed` defaults to a value
        derived from the config seed and the step, so a rerun draws the same tokens; a sequence gives
        each prompt its own. `use_tqdm`: as `LLM.generate`'s, a bool or a tqdm-like class (see
        `rlcheck.forensics.stress.progress_bar`)."""
        if not prompts:
            raise InputError("generate needs at least one prompt")
        if n < 1:
            raise InputError(f"n must be >= 1, got {n}")
        for i, p in enumerate(prompts):
            if isinstance(p, str) or len(p) == 0:
                raise InputError(f"prompt {i}: pass a non-empty list of token ids")
        seed = self.cfg.seed * 1_000_003 + step if seed is None else seed
        found = 0 if self.guard is None else len(self.guard.violations)
        if self.guard is not None:
            self.guard.begin_call(step)
        if isinstance(seed, Sequence) and len(seed) != len(prompts):
            raise InputError(f"{len(seed)} seeds for {len(prompts)} prompts")
        params = [self.sampling_params(n, int(s)) for s in seed] if isinstance(seed, Sequence) else self.sampling_params(n, seed)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(map(int, p))} for p in prompts],
            params,
            use_tqdm=use_tqdm,
        )
        if self.guard is not None and len(self.guard.violations) > found:
            self.guard.flush()  # the trace around the new violations, on disk now
        rollouts = [r for i, out in enumerate(outputs) for r in self._rollouts(i, out, step)]
        if self.routes is not None:
            self.routes.clear()
        return rollouts

    def take_guard_violations(self) -> list[dict[str, Any]]:
        """The guard's violations since the previous call, as dicts with the rollout's id
        (`rollout_request_id`: "{engine_id}/s{step}/{vLLM id}"); [] without a guard."""
        return [] if self.guard is None else [v.to_dict() for v in self.guard.take_violations()]

    def take_guard_report(self) -> dict[str, Any] | None:
        """The guard's `take_report` (new violations as dicts, whether it is alive, the error that stopped
        it, steps traced and skipped); None without a guard."""
        if self.guard is None:
            return None
        report = self.guard.take_report()
        return {**report, "violations": [v.to_dict() for v in report["violations"]]}

    def write_guard(self, directory: str | os.PathLike) -> str | None:
        """Write the guard's record (summary, violations, trace) into DIR/guard, e.g. a dump; None without a guard."""
        return None if self.guard is None else str(self.guard.write(directory))

    def _rollouts(self, prompt_index: int, out: Any, step: int) -> list[Rollout]:
        rollouts = []
        many = len(out.outputs) > 1
        for c in out.outputs:
            vllm_id = f"{c.index}_{out.request_id}" if many else str(out.request_id)
            ids = tuple(int(t) for t in c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned no logprobs for request {vllm_id}")
            lp = np.array([pos[t].logprob for pos, t in zip(c.logprobs, ids, strict=True)], dtype=np.float32)
            top = None
            if self.cfg.top_logprobs:
                top = tuple({int(k): float(v.logprob) for k, v in pos.items()} for pos in c.logprobs)
            rollouts.append(Rollout(
                request_id=f"{self.cfg.engine_id}/s{step}/{vllm_id}",
                vllm_request_id=vllm_id,
                prompt_index=prompt_index,
                sample_index=int(c.index),
                prompt_token_ids=tuple(int(t) for t in out.prompt_token_ids),
                token_ids=ids,
                logprobs=lp,
                top_logprobs=top,
                text=self._text(c, ids),
                finish_reason=c.finish_reason,
                weight_version=self.weight_version,
                step=step,
                experts=None if self.routes is None else self.routes.response(c, vllm_id, len(out.prompt_token_ids), len(ids)),
            ))
        return rollouts

    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load new weights in place (`reload_weights`), bring the Mamba conv buffers that vLLM 0.32's
        CPU backend leaves on the old weights up to date (`vllm_sync.refresh_mamba_conv_weights`, a no-op
        elsewhere; docs/mamba-conv-sync.md) and drop every cache computed with the old weights (prefix
        cache); rollouts generated afterwards carry `version`. A collective sync passes `Buckets`, loaded
        one by one as they arrive (`rlcheck.engines.vllm_collective`), through any fault's wrap of this."""
        from rlcheck.engines.vllm_collective import Buckets, load_buckets

        if isinstance(named_tensors, Buckets):
            return load_buckets(self, named_tensors, version)
        weights = [(name, t.detach().cpu() if hasattr(t, "detach") else t) for name, t in named_tensors]
        load_buckets(self, [weights], version)

    def close(self) -> None:
        """Release the engine (memory and threads); the guard's files are flushed first."""
        if self.guard is not None:
            self.guard.close()
        llm, self.llm = self.llm, None
        del llm
        gc.collect()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def to_step_batch(rollouts: Sequence[Rollout], logp_train: Sequence[Any], tokens_train: Sequence[Any] | None = None,
                  topk: Any = None, routing: Any = None):
    """The monitor's `StepBatch` of these rollouts against the trainer's logprobs of the same tokens
    (one array per rollout, same order); ids, tokens and engine context travel along. `tokens_train`:
    the ids the trainer scored, per rollout, if it tokenised on its own (checked against the sampled ids);
    `topk`: both sides' top-K (`rlcheck.core.topk.TopK`, built by `rlcheck.loop.topk_wiring.recompute`),
    `routing` both sides' MoE experts (`rlcheck.core.moe.Routing`, from the same)."""
    from rlcheck.core.batch import StepBatch

    if len(logp_train) != len(rollouts):
        raise InputError(f"{len(logp_train)} trainer logprob arrays for {len(rollouts)} rollouts")
    return StepBatch.from_ragged(
        logp_rollout=[r.logprobs for r in rollouts],
        logp_train=list(logp_train),
        request_ids=[r.request_id for r in rollouts],
        tokens=[np.asarray(r.token_ids, dtype=np.int64) for r in rollouts],
        tokens_train=None if tokens_train is None else [np.asarray(t, dtype=np.int64) for t in tokens_train],
        prompt_tokens=[np.asarray(r.prompt_token_ids, dtype=np.int64) for r in rollouts],
        weight_version=[r.weight_version for r in rollouts],
        topk=topk,
        routing=routing,
        meta={
            "vllm_request_id": [r.vllm_request_id for r in rollouts],
            "prompt_index": [r.prompt_index for r in rollouts],
            "sample_index": [r.sample_index for r in rollouts],
        },
    )
