"""The HF reference's side of `rlcheck localize`: the hidden state after every decoder layer of one
sequence, and every layer's type. The engine's side, `LayerCapture`, hooks vLLM's runner
(`rlcheck.engines.layer_capture`, re-exported here).

    reference = reference_states(hf_model, token_ids)                  # (L, len(token_ids), H)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.engines.layer_capture import LAYER_OUTPUT, LayerCapture, stream_mode  # noqa: F401 - re-exported


def reference_states(model: Any, token_ids: list[int]) -> np.ndarray:
    """(L, T, H) float32: the output of every decoder layer of an HF model over `token_ids`, one
    sequence alone (no padding), no cache."""
    import torch

    from rlcheck.engines.vllm_perturb import decoder_layers

    layers = decoder_layers(model)
    out: list[Any] = [None] * len(layers)

    def keep(i: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            out[i] = (output[0] if isinstance(output, tuple) else output)[0].detach().float().cpu().numpy()

        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids], dtype=torch.long, device=model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return np.stack(out)


def layer_types(model: Any) -> tuple[str, ...]:
    """The type of every decoder layer of a vLLM or HF model: "attention", "mamba", "mlp" or "moe", its
    token mixer's; "+moe" after it when the layer's MLP is a routed MoE ("attention+moe": Qwen3-MoE)."""
    from rlcheck.engines.vllm_perturb import decoder_layers, output_projection
    from rlcheck.forensics.localize.routing import moe_layers

    routed = set(moe_layers(model))
    kinds = [output_projection(layer)[0] for layer in decoder_layers(model)]
    return tuple(k + "+moe" if i in routed and k != "moe" else k for i, k in enumerate(kinds))
