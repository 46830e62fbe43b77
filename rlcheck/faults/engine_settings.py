"""Faults in how the rollout engine is set up: a prefix cache nobody resets after a weight sync, a RoPE
base the trainer does not have, logprobs returned before the temperature. Each acts through the
engine's config (`Fault.rollout_config`), its prompts (`Fault.prompts`) or a wrap of its weight sync
(`rlcheck.engines.vllm_prefix`); the trainer is left as it is."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcheck.core.batch import StepBatch
from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault, all_ids, check_factor

SYSTEM_PROMPT = ("You are a careful calculator. Read the problem, add the two numbers digit by digit, "
                 "carry where a column passes nine, and answer with the sum alone. ")
"""The system prompt `stale-prefix-cache` puts before half of the prompts (repeated to PREFIX_TOKENS)."""
PREFIX_TOKENS = 320
"""Its length in tokens: two and a half of vLLM's 128-token cache blocks on CPU (a prefix cache hit
needs whole blocks)."""


@dataclass(frozen=True)
class StalePrefixCache(Fault):
    """The engine's prefix cache is not reset after the weight syncs (from the sync before step
    `start` on), and every other prompt of a step opens with the same long system prompt
    (`PREFIX_TOKENS`, after BOS), as real chat prompts do: their shared blocks keep the keys and values
    the old weights computed. Shape: step `start` - 1 and earlier clean; afterwards the sequences whose
    prompt holds the shared prefix are off from their first token (growing as the weights move away
    from those of the cached blocks), the others match; the sync check finds the weights right.
    Needs an attention-only model (vLLM 0.32's CPU backend fails a hybrid's long prefills: refused)."""

    name = "stale-prefix-cache"
    cause = "stale_prefix_cache"
    shape = "prompts sharing a cached prefix off after each sync; the others clean"

    def rollout_config(self, cfg):
        if not cfg.engine_kwargs.get("enable_prefix_caching", True):
            raise ConfigError("stale-prefix-cache needs vLLM's prefix caching on (enable_prefix_caching)")
        attention_only(model_config(cfg.model, self.name), self.name)
        return cfg

    def engine_fault(self) -> tuple[str, dict[str, Any]]:
        return "stale-prefix-cache", {"start": max(self.start, 1)}

    def prompts(self, step: int, prompts: list[list[int]], tokenizer: Any) -> list[list[int]]:
        return with_context(prompts, tokenizer, shared=True)

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        """The batch as it is; touched: from `start` on, the sequences whose prompt holds the shared prefix
        (the only prompts that long), which the stale cache serves."""
        if not self.active(step) or batch.prompt_tokens is None:
            return batch, []
        return batch, [rid for rid, p in zip(batch.request_ids, batch.prompt_tokens, strict=True) if p.size >= PREFIX_TOKENS]


def system_prompt(tokenizer: Any, length: int = PREFIX_TOKENS) -> list[int]:
    """`SYSTEM_PROMPT` repeated and tokenized, cut to `length` tokens."""
    ids = tokenizer.encode(SYSTEM_PROMPT * (1 + length // 16), add_special_tokens=False)
    return list(ids[:length])


def with_context(prompts: list[list[int]], tokenizer: Any, shared: bool) -> list[list[int]]:
    """Every other prompt (0, 2, ...) with `PREFIX_TOKENS` of context after its BOS: the same system
    prompt for all (`shared`), or one of its own (the system prompt rotated by a per-prompt offset, so no
    two share a prefix: a long document of its own); the others as they are."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    system = system_prompt(tokenizer)
    out = []
    for i, p in enumerate(prompts):
        k = 0 if shared else (37 * i) % len(system)
        out.append(bos + system[k:] + system[:k] + p[len(bos):] if i % 2 == 0 else p)
    return out


@dataclass(frozen=True)
class RopeMismatch(Fault):
    """The engine runs the model with its RoPE base (rope_theta) x `factor` (vLLM `hf_overrides`), the
    trainer with the checkpoint's: the same weights at the same positions rotated otherwise. Every
    other prompt carries a long context of its own (`with_context`: `PREFIX_TOKENS`, no prefix shared),
    so that the sequences reach far positions (an attention-only model, as `stale-prefix-cache`). Shape: close at the first positions, off further in the
    sequence (relative distances the two bases rotate apart), from the first step; the fingerprints agree.
    On the tiny random Llama (HF, 32 sampled tokens): F = 4 puts the first tokens after a short prompt
    ~5e-3 nats apart, its last ones ~1e-2, those after 320 tokens of context ~2e-2; the tiny trained
    Llama is sensitive at every distance (F = 1.01: 1e-2 to 0.1 after long contexts, up to 8e-3 after
    short ones; F = 1.25: 0.4 everywhere)."""

    factor: float = 4.0
    name = "rope-mismatch"
    cause = "position_dependent"
    shape = "fine early, off past a position"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_factor(self.name, self.factor, self.start, "the engine's model config")

    def rollout_config(self, cfg):
        rope = rope_parameters(cfg.model)
        attention_only(model_config(cfg.model, self.name), self.name)
        overrides = dict(cfg.engine_kwargs.get("hf_overrides") or {})
        overrides["rope_parameters"] = {**rope, "rope_theta": float(rope["rope_theta"]) * self.factor}
        return dataclasses.replace(cfg, engine_kwargs={**cfg.engine_kwargs, "hf_overrides": overrides})

    def prompts(self, step: int, prompts: list[list[int]], tokenizer: Any) -> list[list[int]]:
        return with_context(prompts, tokenizer, shared=False)

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        return batch, all_ids(batch)  # every sequence is computed at the engine's base

    def value(self) -> str:
        return f"{self.factor:g}"


def model_config(model: str, fault: str) -> dict[str, Any]:
    """The model folder's config.json (ConfigError naming `fault` when it cannot be read)."""
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{fault} reads the model's config.json: {path}: {exc}") from None


def attention_only(config: dict[str, Any], fault: str) -> None:
    """ConfigError for a model with Mamba layers: the fault's 320-token prompts fail vLLM 0.32's CPU
    prefill of a hybrid (an IndexError in the Mamba mixer's chunked prefill)."""
    from rlcheck.core.model_types import RECURRENT_MODEL_TYPES

    if config.get("model_type") in RECURRENT_MODEL_TYPES:
        raise ConfigError(f"{fault} needs an attention-only model (its long prompts fail vLLM 0.32's CPU prefill of "
                          f"a {config['model_type']} model); e.g. --model runs/models/llama-trained")


def rope_parameters(model: str) -> dict[str, Any]:
    """The RoPE parameters of the model folder's config.json (transformers' `rope_parameters`, or the
    older top-level `rope_theta`); ConfigError for a model without RoPE."""
    config = model_config(model, "rope-mismatch")
    rope = config.get("rope_parameters") or ({"rope_theta": config["rope_theta"]} if "rope_theta" in config else None)
    if not rope or "rope_theta" not in rope:
        raise ConfigError("rope-mismatch needs a model with RoPE (rope_theta in its config.json), e.g. a llama")
    return dict(rope)


@dataclass(frozen=True)
class RawLogprobs(Fault):
    """The engine returns raw logprobs (vLLM `logprobs_mode="raw_logprobs"`, log_softmax of the logits
    before the temperature) while both sides sample and score at T = `TEMPERATURE` (the loop's own
    temperature when it is not 1). Shape: systematic, d = logp_train - logp_rollout follows
    logp_rollout (a slope of about 1/T - 1), as a temperature mismatch does."""

    name = "raw-logprobs"
    cause = "logit_processing"
    shape = "systematic: d follows logp_rollout (logprobs before the temperature)"
    TEMPERATURE = 0.7

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start:
            raise ConfigError("raw-logprobs acts from the first step (it changes the engine's config)")

    def temperature(self, current: float) -> float:
        return self.TEMPERATURE if current == 1.0 else current

    def rollout_config(self, cfg):
        if cfg.greedy:
            raise ConfigError("raw-logprobs needs sampling at a temperature (greedy logprobs are raw anyway)")
        return dataclasses.replace(cfg, logprobs_mode="raw_logprobs", temperature=self.temperature(cfg.temperature))

    def trainer_config(self, cfg):
        return dataclasses.replace(cfg, temperature=self.temperature(cfg.temperature))

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        return batch, all_ids(batch)  # every logprob the engine returns is raw
