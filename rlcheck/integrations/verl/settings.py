"""The verl plugin's settings (`rlcheck.integrations.verl.plugin`): the `rlcheck` section of verl's own
config, given on verl's command line, and the verl settings it refuses before verl starts anything.

    python -m verl.trainer.main_ppo ... +rlcheck.quarantine=true +rlcheck.rollout_is=token

| key | default | what it does |
|---|---|---|
| `enable` | true | false: the plugin stays out of this run |
| `run_dir` | `<trainer.default_local_dir>/rlcheck` | rlcheck's run directory, beside verl's checkpoints |
| `quarantine` | false | take the few sequences the evidence condemns out of the step (`QuarantineConfig()`) instead of halting; they leave verl's `response_mask` |
| `rollout_is`, `rollout_is_threshold`, `rollout_rs`, `rollout_rs_threshold`, `rollout_is_batch_normalize` | off | rlcheck's rollout correction (verl's fields, `CorrectionConfig`): `rollout_is_weights` and the rejection reach verl's loss |
| `halt` | true | false: alarms are logged, the run never stops |
| `max_weight_lag` | 0 | weight versions a row may lag (legacy and v1 trainers are on-policy) |
| `sinks` | [] | extra views of each step's record ("console", "wandb"); verl's own logger always gets the metrics |

Refused (`ConfigError`, before verl's workers and vLLM start), each with its fix, all at once:
`actor_rollout_ref.rollout.calculate_log_probs=false` (no engine logprobs to compare),
`algorithm.rollout_correction.bypass_mode=true` (old_log_probs are the engine's own: nothing to compare;
the legacy trainer then never recomputes them), rlcheck's `rollout_is` beside verl's own
`algorithm.rollout_correction.rollout_is` (two sets of weights for one loss), the v1 trainer's
off-policy modes (`trainer.v1.trainer_mode` colocate_async / separate_async: not supported yet), and an
unknown key in the `rlcheck` section.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlcheck.core.correction import CorrectionConfig
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


SECTION = "rlcheck"
CORRECTION_KEYS = tuple(f.name for f in dataclasses.fields(CorrectionConfig))
KEYS = ("enable", "run_dir", "quarantine", "halt", "max_weight_lag", "sinks", *CORRECTION_KEYS)


@dataclass(frozen=True)
class VerlSettings:
    """What rlcheck does inside one verl run (module docstring)."""

    run_dir: str
    quarantine: bool = False
    correction: CorrectionConfig | None = None
    halt: bool = True
    max_weight_lag: int = 0
    sinks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not str(self.run_dir):
            raise ConfigError("rlcheck.run_dir must be a directory path")
        if isinstance(self.max_weight_lag, bool) or not isinstance(self.max_weight_lag, int) or self.max_weight_lag < 0:
            raise ConfigError(f"rlcheck.max_weight_lag must be a non-negative integer, got {self.max_weight_lag!r}")


def _section(config: Any) -> dict[str, Any] | None:
    node = get(config, SECTION)
    if node is None:
        return None
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            node = OmegaConf.to_container(node, resolve=True)
    except ImportError:  # a plain mapping (tests)
        pass
    if not isinstance(node, Mapping):
        raise ConfigError(f"verl's `{SECTION}` config must be a section (+{SECTION}.quarantine=true ...), got {node!r}")
    unknown = sorted(set(node) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in verl's `{SECTION}` section; known: {', '.join(KEYS)}")
    return dict(node)


def settings_of(config: Any, *, loaded_by_name: bool) -> VerlSettings | None:
    """The settings of verl's `config`; None when rlcheck stays out: no `rlcheck` section and the plugin
    not named in VERL_USE_EXTERNAL_MODULES (`loaded_by_name`), or `rlcheck.enable=false`."""
    section = _section(config)
    if (section is None and not loaded_by_name) or not bool((section or {}).get("enable", True)):
        return None
    section = section or {}
    correction = {k: section[k] for k in CORRECTION_KEYS if section.get(k) is not None}
    default_dir = os.path.join(str(get(config, "trainer.default_local_dir", "checkpoints")), "rlcheck")
    return VerlSettings(
        run_dir=str(section.get("run_dir") or default_dir),
        quarantine=bool(section.get("quarantine", False)),
        correction=CorrectionConfig(**correction) if correction else None,
        halt=bool(section.get("halt", True)),
        max_weight_lag=section.get("max_weight_lag", 0),
        sinks=tuple(section.get("sinks") or ()),
    )


def refusals(config: Any, settings: VerlSettings) -> list[str]:
    """The verl settings rlcheck cannot work with (module docstring), each with its fix."""
    found = []
    if not get(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        found.append("actor_rollout_ref.rollout.calculate_log_probs=false: verl keeps no engine logprobs "
                     "(rollout_log_probs) to compare; set it to true")
    correction = "algorithm.rollout_correction"
    if get(config, f"{correction}.bypass_mode", False):
        found.append(f"{correction}.bypass_mode=true: verl uses the engine's logprobs as old_log_probs and never "
                     "recomputes them, so there is nothing to compare; turn bypass mode off")
    if settings.correction is not None and settings.correction.rollout_is and get(config, f"{correction}.rollout_is"):
        found.append(f"rlcheck.rollout_is with verl's own {correction}.rollout_is: two sets of importance weights "
                     "for one loss; keep one of them")
    mode = get(config, "trainer.v1.trainer_mode", "sync")
    if get(config, "trainer.use_v1", True) and mode != "sync":
        found.append(f"trainer.v1.trainer_mode={mode}: the v1 trainer's off-policy modes are not supported yet "
                     "(their rows lag the actor by design); use trainer_mode=sync, the legacy trainer, or the "
                     "fully async trainer (verl.experimental.fully_async_policy)")
    return found


def check(config: Any, settings: VerlSettings) -> None:
    """Raise one `ConfigError` naming every refused setting (`refusals`)."""
    found = refusals(config, settings)
    if found:
        raise ConfigError("rlcheck cannot watch this verl run:\n" + "\n".join(f"  - {f}" for f in found))
