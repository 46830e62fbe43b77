"""The static preflight: every setting on which the engine and the trainer would differ, found from
their configs, tokenizers and settings before anything runs.

    found = run_static(PreflightConfig(model="models/a", engine_model="models/b", temperature=0.7))
    found.differs, found.keys()          # True, ["rope_theta", "logprobs_mode", ...]

Checks (each a pure function returning findings; keys in parentheses):
- model configs (`rlcheck.preflight.models`): vocab, shapes, RoPE base and scaling, sliding window, tied
  embeddings, BOS / EOS ids (`vocab_size`, `rope_theta`, `rope_scaling`, `sliding_window`, ...), and the
  engine model's sampling defaults (`generation_defaults`);
- tokenizers (`rlcheck.preflight.tokens`): vocabulary, special tokens, chat template, BOS twice
  (`tokenizer_vocab`, `special_tokens`, `chat_template`, `double_bos`, `tokenizer_size`);
- dtype: what each side computes in (`dtype`);
- sampling vs what the trainer scores (`logprobs_mode`, `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty`): the trainer scores log_softmax(logits / T) over the whole vocabulary;
- the prefix cache vs who resets it after a weight sync (`prefix_cache`).
"""

from __future__ import annotations

from typing import Any

from rlcheck.preflight.config import PreflightConfig, canonical_dtype
from rlcheck.preflight.findings import Finding, Preflight, worst_first
from rlcheck.preflight.models import check_configs, check_generation_defaults
from rlcheck.preflight.sides import Side, config_dtype, engine_side, load_side
from rlcheck.preflight.tokens import check_double_bos, check_tokenizer_size, check_tokenizers

FILTERS = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
"""Sampling settings that reshape the distribution vLLM samples from, and their neutral values."""
SCORES = "log_softmax(logits / T) over the full vocabulary"


def check_sampling(cfg: PreflightConfig) -> list[Finding]:
    """What the engine reports against what the trainer scores (`SCORES`, at `cfg.scored_temperature`)."""
    mode, t, scored = cfg.logprobs_mode, cfg.temperature, cfg.scored_temperature
    if mode.endswith("_logits"):
        return [Finding("logprobs_mode", "critical", "logprobs", mode,
                        f"vLLM returns logits in {mode}, not logprobs: there is nothing to compare them with.",
                        "Set vLLM's logprobs_mode='processed_logprobs'.")]
    out = []
    if mode == "raw_logprobs" and scored != 1:
        out.append(Finding("logprobs_mode", "error", f"T={scored:g}", "raw_logprobs (T=1)",
                           f"raw logprobs ignore the temperature while the trainer scores at T={scored:g}: every "
                           "token's d = l_train - l_rollout correlates with l_rollout.",
                           "Set vLLM's logprobs_mode='processed_logprobs' (logprobs at the sampling temperature), "
                           "or score the trainer side at T=1."))
    if mode == "processed_logprobs" and scored != t:
        out.append(Finding("temperature", "error", scored, t,
                           f"the engine's logprobs are at T={t:g}, the trainer's at T={scored:g}.",
                           "Score the trainer side at the engine's sampling temperature."))
    for key, neutral in FILTERS.items():
        value = getattr(cfg, key)
        if value == neutral or (key == "top_k" and value == -1):
            continue
        out.append(_filter_finding(key, value, mode))
    return out


def _filter_finding(key: str, value: Any, mode: str) -> Finding:
    if mode == "processed_logprobs":
        return Finding(key, "error", f"not applied ({SCORES})", value,
                       f"processed logprobs are those of the distribution after {key}={value!r} (renormalised); "
                       "the trainer does not apply it, so every kept token's logprob differs.",
                       f"Sample without {key} (its neutral value), or accept the mismatch it causes "
                       "(allow_logit_processing=True in rlcheck's engine and TRL adapter).")
    return Finding(key, "info", f"not applied ({SCORES})", value,
                   f"raw logprobs ignore {key}={value!r}, so the two sides' logprobs compare; the tokens were "
                   "sampled from another distribution than either side reports.",
                   f"Nothing to fix for the comparison; an importance ratio against the sampler needs {key} off.")


def check_prefix_cache(cfg: PreflightConfig) -> list[Finding]:
    """Prefix caching on, and whether the weight sync resets it."""
    if not cfg.prefix_caching or cfg.resets_prefix_cache:
        return []
    if cfg.resets_prefix_cache is None:
        return [Finding("prefix_cache", "info", None, "enabled",
                        "vLLM caches prompt prefixes (its default); after a weight sync a cached prefix still holds "
                        "the old weights' keys and values unless the cache is reset. rlcheck's loop, TRL 1.16 and "
                        "verl 0.9 reset it after every sync.",
                        "If your own code syncs the weights, call llm.reset_prefix_cache() after each sync.")]
    return [Finding("prefix_cache", "error", "reset: never", "enabled",
                    "prefix caching is on and nothing resets it after a weight sync: prompts that share a cached "
                    "prefix are continued from the old weights' keys and values (stale prefix cache).",
                    "Call llm.reset_prefix_cache() after each weight sync, or disable enable_prefix_caching.")]


def check_eager(cfg: PreflightConfig) -> list[Finding]:
    """An engine on a GPU that runs eager: what is monitored is not the engine production runs."""
    if not cfg.enforce_eager:
        return []
    return [Finding("enforce_eager", "info", None, "eager",
                    "the engine runs eager (enforce_eager=True, rlcheck's VLLMConfig default): no CUDA graphs, so it "
                    "is slower than a production engine, and the graph-captured kernels production runs are not "
                    "what is monitored.",
                    "Set VLLMConfig(enforce_eager=False) to monitor the engine as production runs it (the engine "
                    "guard, engine faults and MoE routing capture keep eager: they hook the forward pass).")]


def resolve_engine_dtype(asked: str | None, config: str | None) -> str:
    """The dtype the engine computes in: `asked`, else the config's; vLLM's "auto" runs a float32
    checkpoint in bfloat16 (the first dtype a GPU platform supports)."""
    config = config or "float32"
    if asked is None:
        return config
    if asked == "auto":
        return "bfloat16" if config == "float32" else config
    return asked


def check_dtype(cfg: PreflightConfig, trainer: Side, engine: Side) -> list[Finding]:
    """The two sides computing in different dtypes."""
    engine_cfg = canonical_dtype(config_dtype(engine.config) or "float32", "the engine config's dtype")
    e = resolve_engine_dtype(cfg.dtype, engine_cfg)
    t = cfg.trainer_dtype or canonical_dtype(config_dtype(trainer.config) or "float32", "the trainer config's dtype")
    if e == t:
        return []
    how = " (vLLM's dtype='auto' on a float32 checkpoint)" if cfg.dtype == "auto" and e != engine_cfg else ""
    return [Finding("dtype", "warn", t, e + how,
                    f"the engine computes in {e}, the trainer in {t}: their logprobs differ by the lower "
                    "precision's rounding (mean |d| ~1e-2 and a tail past 0.1 nats in bfloat16, ~1e-6 in float32).",
                    f"Run both sides in one dtype (e.g. vLLM dtype='{t}'), or judge the run at the lower "
                    "precision's thresholds.")]


def check_sides(trainer: Side, engine: Side) -> list[Finding]:
    """Configs and tokenizers of the two sides, plus what each could not read (info)."""
    out = [Finding("unread", "info", None, None, p, "Point the preflight at a complete model folder.")
           for p in trainer.problems + engine.problems]
    if trainer.config is not None and engine.config is not None:
        out += check_configs(trainer.config, engine.config)
    out += check_generation_defaults(engine.generation)
    if trainer.tokenizer is not None and engine.tokenizer is not None and trainer.tokenizer is not engine.tokenizer:
        out += check_tokenizers(trainer.tokenizer, engine.tokenizer)
    for side in (trainer, engine) if engine.tokenizer is not trainer.tokenizer else (trainer,):
        if side.tokenizer is not None:
            out += check_double_bos(side.tokenizer, side.name)
            out += check_tokenizer_size(side.tokenizer, side.config, side.name)
    return out


def run_static(cfg: PreflightConfig, trainer: Side | None = None, engine: Side | None = None) -> Preflight:
    """Every static check; `trainer` / `engine`: sides already built (e.g. a model in memory), else read
    from `cfg.model` / `cfg.engine_path` (once when they are the same folder)."""
    trainer = trainer or load_side("trainer", cfg.model)
    engine = engine_side(cfg, trainer, engine)
    findings = check_sides(trainer, engine) + check_dtype(cfg, trainer, engine)
    findings += check_sampling(cfg) + check_prefix_cache(cfg) + check_eager(cfg)
    return Preflight(str(trainer.path or cfg.model), str(engine.path or cfg.engine_path), worst_first(findings))
