"""Model configs: the fields on which the engine's config and the trainer's decide a different function
of the same weights, and the sampling defaults a model folder ships (generation_config.json).

    findings = check_configs(trainer_config, engine_config)      # dicts, as config.json holds them

Both configs are read through transformers' own config class first (`normalized`), so a field it fills
in or derives on one side (the trainer's config comes from the model in memory) is filled in on the
other too: an identical model gives no finding.

RoPE is read in either layout: transformers 4's `rope_theta` + `rope_scaling`, or transformers 5's
`rope_parameters` ({"rope_theta": ..., "rope_type": ..., "factor": ...}, or one such dict per layer
type); a "default" rope type with nothing else is no scaling.
"""

from __future__ import annotations

from typing import Any

from rlcheck.preflight.findings import Finding

UNSET = "(unset)"
SHAPES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim")
WINDOWS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
NUMERICS = ("rms_norm_eps", "layer_norm_eps", "hidden_act", "attn_logit_softcapping", "final_logit_softcapping",
            "logit_scale")
_OVERRIDE = "Pass vLLM hf_overrides={{{key!r}: <the trainer's value>}} (or load both sides from one model folder)"
_ROPE = ("Load the engine with the trainer's RoPE settings: the same config.json, or vLLM hf_overrides="
         "{{'rope_parameters': <the trainer's>}} (transformers 5; {key!r} with transformers 4)")
FIELDS: dict[str, tuple[str, str, str]] = {
    "model_type": ("error", "the sides run different model classes", "Load both sides from one model folder"),
    "architectures": ("error", "the sides run different model classes", "Load both sides from one model folder"),
    "vocab_size": ("critical", "the logits cover different vocabularies: a token id picks different rows",
                   "Load both sides from one model folder (same embeddings, same tokenizer)"),
    **{k: ("error", "the sides build networks of different shapes", "Load both sides from one model folder")
       for k in SHAPES},
    **{k: ("error", "every layer computes a different function", _OVERRIDE) for k in NUMERICS},
    "rope_theta": ("error", "the RoPE base differs: every position after the first is rotated differently, "
                   "so attention scores drift apart with distance", _ROPE),
    "rope_scaling": ("error", "the RoPE scaling differs (type, factor or original context): positions are "
                     "encoded differently", _ROPE),
    **{k: ("error", "attention sees a different window: tokens past it are scored with different context",
           _OVERRIDE) for k in WINDOWS},
    "tie_word_embeddings": ("error", "one side ties the LM head to the embeddings, the other loads its own", _OVERRIDE),
    "bos_token_id": ("warn", "the sides open sequences with different tokens", _OVERRIDE),
    "eos_token_id": ("warn", "the sides stop at different tokens: the stop token's logprob is in one side's "
                     "sequence and not the other's", _OVERRIDE),
    "max_position_embeddings": ("warn", "the context length differs (long-context RoPE variants scale by it)",
                                _OVERRIDE),
}
"""config field -> (severity, what a difference does, fix) for the fields compared, in report order."""
OFF_WHEN_UNSET = ("rope_scaling", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
"""Fields whose absence means "none" in every model class (no scaling, no window), so unset vs set is a
full difference; any other field unset on one side may be its class's default (a warning at most)."""
GENERATION = {"temperature": (1.0,), "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,),
              "repetition_penalty": (1.0,)}
"""generation_config.json fields that change what vLLM samples from, and their neutral values."""


def flat(config: dict[str, Any]) -> dict[str, Any]:
    """The config with a multimodal model's `text_config` fields filled in where the top level lacks
    them, and RoPE as `rope_theta` / `rope_scaling` whatever the layout."""
    text = config.get("text_config")
    out = {**(text if isinstance(text, dict) else {}), **config}
    theta, scaling = rope(out)
    out.pop("rope_parameters", None)
    out.update(rope_theta=theta, rope_scaling=scaling)
    return out


def rope(config: dict[str, Any]) -> tuple[Any, Any]:
    """(rope_theta, rope_scaling) in either layout (module docstring); None where unset."""
    theta, scaling, params = config.get("rope_theta"), config.get("rope_scaling"), config.get("rope_parameters")
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):  # one per layer type
            theta = theta if theta is not None else {k: v.get("rope_theta") for k, v in params.items()}
            per_type = {k: _scaling(v) for k, v in params.items()}
            scaling = scaling if scaling is not None else (per_type if any(per_type.values()) else None)
        else:
            theta = theta if theta is not None else params.get("rope_theta")
            scaling = scaling if scaling is not None else _scaling(params)
    return theta, _scaling(scaling) if isinstance(scaling, dict) else scaling


def _scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = rest.get("rope_type", rest.get("type"))
    if kind in (None, "default") and set(rest) <= {"rope_type", "type"}:
        return None
    return rest


def normalized(config: dict[str, Any]) -> dict[str, Any] | None:
    """`config` as transformers builds it: its model type's config class made from these fields, then
    `to_dict()`, the class defaults filled in and the derived fields set (Qwen2's `sliding_window` None
    unless `use_sliding_window`, `layer_types`, Gemma 3's RoPE per layer type, a yarn `rope_type` beside
    its `type`), as the trainer's model and vLLM (which reads configs through transformers) both see
    them. None when transformers, or a config class for the model type, is not there to build it."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return None
    try:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a config's own deprecation notes are not the preflight's findings
    try:
        fields = {k: v for k, v in config.items() if k != "model_type"}
        return AutoConfig.for_model(model_type, **fields).to_dict()
    except Exception:  # noqa: BLE001 - an unknown type (remote code) or a config its class refuses: compared as written
        return None
    finally:
        hf_logging.set_verbosity(level)


def check_configs(trainer: dict[str, Any], engine: dict[str, Any]) -> list[Finding]:
    """One finding per `FIELDS` entry the two configs disagree on, both read through the same
    normalisation (`normalized`: the trainer's config comes from a model in memory, the engine's from
    config.json; transformers fills and derives fields for both). Where either cannot be normalised
    both are compared as written: None counts as unset, and a field set on one side only is "warn" at
    most (the other side's class default may be the same value), except the `OFF_WHEN_UNSET` ones."""
    both = normalized(trainer), normalized(engine)
    if None not in both:
        trainer, engine = both
    t, e = flat(trainer), flat(engine)
    out = []
    for key, (severity, why, fix) in FIELDS.items():
        tv, ev = t.get(key), e.get(key)
        if _same(tv, ev):
            continue
        if (tv is None or ev is None) and key not in OFF_WHEN_UNSET:
            tv, ev = (UNSET if tv is None else tv), (UNSET if ev is None else ev)
            severity, why = ("warn" if severity != "info" else severity), f"set on one side only: {why}"
        out.append(Finding(key, severity, tv, ev, f"{why}.", fix.format(key=key) + "."))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def check_generation_defaults(generation: dict[str, Any]) -> list[Finding]:
    """An info finding when the engine model's generation_config.json sets a sampling field."""
    found = {k: generation[k] for k, neutral in GENERATION.items()
             if generation.get(k) is not None and generation[k] not in neutral}
    if not found:
        return []
    return [Finding(
        "generation_defaults", "info", None, found,
        "the engine model's generation_config.json sets sampling defaults: vLLM's server (and LLM.generate "
        "without SamplingParams) applies them to requests that leave these fields unset, and then reports "
        "the logprobs of the filtered distribution.",
        "Set every sampling field explicitly in each request, or start vLLM with generation_config='vllm'.")]
