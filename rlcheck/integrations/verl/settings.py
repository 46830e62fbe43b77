"""verl's trainer config as rlcheck reads it (an OmegaConf config, a dataclass or nested mappings), and
the setting rlcheck cannot work under: bypass mode, where verl never recomputes the logprobs."""

from __future__ import annotations

from typing import Any

from rlcheck.errors import ConfigError


def get(config: Any, dotted: str, default: Any = None) -> Any:
    """`config.a.b.c` of an OmegaConf config, a dataclass or nested mappings; `default` where missing or None."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") and not hasattr(node, part) else getattr(node, part, None)
    return default if node is None else node


def refuse_bypass(config: Any) -> None:
    """ConfigError when verl's config is in bypass mode (`algorithm.rollout_correction.bypass_mode`):
    verl then hands `rollout_log_probs` over as `old_log_probs` (the same buffer, or a copy through v1's
    transfer queue) and never calls `_compute_old_log_prob`, where rlcheck's hook observes; bitwise-equal
    sides alone cannot tell that from a true on-policy engine."""
    if get(config, "algorithm.rollout_correction.bypass_mode", False) is True:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=True: verl uses the rollout's logprobs as old_log_probs "
            "and never recomputes them, so rlcheck would compare the rollout side with itself; turn bypass mode "
            "off to have the trainer's own logprobs checked")
