"""The decoder layers of a causal LM, vLLM's or Hugging Face's, found by one rule (the trainers shard
them, the engine faults and localize hook them, the MoE tools read their routers).

    layers = decoder_layers(model)      # list of the text decoder's layers, in order

The rule: the language model first, where the model says which it is (vLLM's multimodal models:
`get_language_model()`; Hugging Face's: `get_decoder()`), then its ModuleList named `layers`; where
that leaves several (or the model names no language model), the one beside the token embedding (a
module with `num_embeddings`: `embed_tokens`, Mamba2's `embeddings`). So a vision tower's
`encoder.layers`, which comes first in a LLaVA-style model's modules, is never taken for the decoder.
"""

from __future__ import annotations

from typing import Any

from rlcheck.errors import ConfigError


def decoder_layers(model: Any) -> list[Any]:
    """The text decoder's layers of a vLLM or HF causal LM, in order (see the module docstring)."""
    root = language_model(model)
    found = _layer_lists(root)
    if len(found) > 1:
        found = [(name, m) for name, m in found if _beside_token_embedding(root, name)]
    if len(found) == 1:
        return list(found[0][1])
    names = ", ".join(name for name, _ in _layer_lists(root)) or "none"
    raise ConfigError(f"{type(model).__name__}: cannot tell its text decoder's layers (ModuleLists named "
                      f"'layers' beside a token embedding; found {names})")


def language_model(model: Any) -> Any:
    """The part of `model` that is the language model: what `get_language_model()` (vLLM) or
    `get_decoder()` (Hugging Face) names when it holds a `layers` list, else the model itself."""
    for getter in ("get_language_model", "get_decoder"):
        get = getattr(model, getter, None)
        if not callable(get):
            continue
        try:
            part = get()
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            continue
        if part is not None and part is not model and _layer_lists(part):
            return part
    return model


def _layer_lists(root: Any) -> list[tuple[str, Any]]:
    import torch

    return [(name, m) for name, m in root.named_modules()
            if name.rpartition(".")[2] == "layers" and isinstance(m, torch.nn.ModuleList)]


def _beside_token_embedding(root: Any, name: str) -> bool:
    """Whether the module holding the list `name` also holds a token embedding (a child with `num_embeddings`)."""
    parent = root.get_submodule(name.rpartition(".")[0]) if "." in name else root
    return any(hasattr(child, "num_embeddings") for child in parent.children())
