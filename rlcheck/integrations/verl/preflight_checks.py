"""The verl adapter's preflight (`rlcheck.preflight`): the static checks of a verl 0.9 trainer config
(`actor_rollout_ref`), run before verl starts its workers and vLLM (`rlcheck.integrations.verl.preflight`).

What each side loads, as verl 0.9 does it:
- engine: vLLM serves `model.path` as it is on disk, with `rollout.engine_kwargs.vllm.hf_overrides` on top
  (verl spreads `engine_kwargs.vllm` over vLLM's arguments, its own quantization overrides under it), in
  `rollout.dtype`, with `rollout.logprobs_mode`, `rollout.enable_prefix_caching`, and the sampling of
  `rollout.temperature` / `top_p` / `top_k` / `repetition_penalty`; verl resets the prefix cache after
  every weight update (`update_weights` -> `clear_kv_cache`).
- trainer: the config of `model.hf_config_path` (default `model.path`) with the tokenizer's BOS / EOS /
  PAD ids and then `model.override_config` applied (`HFModelConfig.__post_init__`): an override there
  (a RoPE base, a window) is the trainer's alone. It scores log_softmax(logits / temperature) in
  `actor.fsdp_config.dtype` (bfloat16 by default), with the tokenizer of `model.tokenizer_path`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlcheck.integrations.verl.settings import get, refuse_bypass
from rlcheck.preflight import Finding, PreflightConfig, Side, attach_check, load_side
from rlcheck.preflight.models import normalized

WHERE = "verl, before its workers and vLLM start"


def _local(path: Any) -> str | None:
    if not path:
        return None
    path = os.path.expanduser(str(path))
    return path if Path(path).is_dir() else None


def trainer_side(config: Any, path: str) -> Side:
    """The trainer's side: `hf_config_path`'s config with the tokenizer's special ids and
    `override_config` on top (see the module docstring)."""
    model = "actor_rollout_ref.model"
    side = load_side("trainer", _local(get(config, f"{model}.hf_config_path")) or path, with_tokenizer=False)
    tokenizer_dir = _local(get(config, f"{model}.tokenizer_path")) or path
    tok = load_side("trainer", tokenizer_dir).tokenizer
    overrides = dict(get(config, f"{model}.override_config", {}) or {})
    overrides = dict(overrides.get("model_config", overrides))
    ids = {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} if tok is not None else {}
    # verl sets each override on the config object transformers built (`update_model_config`: setattr),
    # so they go on top of the normalised config, where a field its class does not read stays unread
    base = None if side.config is None else normalized(side.config) or side.config
    cfg = None if base is None else {**base, **{k: v for k, v in ids.items() if v is not None}, **overrides}
    return Side("trainer", path, cfg, side.generation, tok, side.problems)


def engine_overrides(config: Any) -> dict[str, Any] | None:
    """`rollout.engine_kwargs.vllm.hf_overrides`: a dict, or the JSON text vLLM's command line takes; None
    without (an unreadable text is left to vLLM, which refuses it)."""
    value = get(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides", None)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return _plain(value) if isinstance(value, Mapping) and value else None


def _plain(value: Any) -> Any:
    """An OmegaConf node (or any mapping / sequence) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def preflight_config(config: Any, path: str) -> PreflightConfig:
    """The two sides' settings from verl's `actor_rollout_ref` (see the module docstring)."""
    rollout = "actor_rollout_ref.rollout"
    return PreflightConfig(
        model=path, engine_overrides=engine_overrides(config), temperature=float(get(config, f"{rollout}.temperature", 1.0)),
        top_p=float(get(config, f"{rollout}.top_p", 1.0)), top_k=int(get(config, f"{rollout}.top_k", -1)),
        repetition_penalty=float(get(config, f"{rollout}.repetition_penalty", 1.0)),
        logprobs_mode=str(get(config, f"{rollout}.logprobs_mode", "processed_logprobs")),
        dtype=str(get(config, f"{rollout}.dtype", "bfloat16")),
        trainer_dtype=str(get(config, "actor_rollout_ref.actor.fsdp_config.dtype", "bfloat16")),
        prefix_caching=bool(get(config, f"{rollout}.enable_prefix_caching", True)), resets_prefix_cache=True,
        enforce_eager=bool(get(config, f"{rollout}.enforce_eager", False)))  # verl runs vLLM on GPUs


def verl_precision(config: Any):
    """The dtypes of the two sides of a verl config (`rollout.dtype`, `actor.fsdp_config.dtype`, verl's
    defaults bfloat16), as the Monitor's `precision` (`rlcheck.core.floors`); a dtype rlcheck does not know
    leaves the pair unknown (the run calibrates itself)."""
    from rlcheck.core.floors import Precision
    from rlcheck.errors import ConfigError

    try:
        return Precision(engine=str(get(config, "actor_rollout_ref.rollout.dtype", "bfloat16")),
                         trainer=str(get(config, "actor_rollout_ref.actor.fsdp_config.dtype", "bfloat16")))
    except ConfigError:
        return Precision()


def verl_preflight(config: Any) -> tuple[Finding, ...]:
    """The static preflight of a verl config; () when `model.path` is not a local folder (an HDFS path
    verl copies at start: run `rlcheck preflight` on the copy). Bypass mode is refused first: verl then
    hands `rollout_log_probs` over as `old_log_probs` and never recomputes them (nor calls
    `_compute_old_log_prob`, where rlcheck's hook observes), so there is nothing to compare."""
    refuse_bypass(config)
    path = _local(get(config, "actor_rollout_ref.model.path"))
    if path is None:
        return ()
    engine = load_side("engine", path)
    return attach_check(preflight_config(config, path), trainer_side(config, path), engine, where=WHERE)
