"""The `perturb-layer=K` engine fault, and where the output projections of decoder layers live in
vLLM's and HF's models (both name them alike: Llama, Mamba2, GraniteMoeHybrid).

    handle = inject(engine, "perturb-layer", layer=2)   # rlcheck.engines.vllm_faults.inject
    handle.target     # "decoder layer 2 (attention) self_attn.o_proj"
    handle.remove()

Inside vLLM only, decoder layer K's output projection (attention `self_attn.o_proj`, Mamba
`mamba.out_proj` in GraniteMoeHybrid, `mixer.out_proj` in Mamba2) computes PERTURB_FACTOR (1.01) x
its output: the shape of one layer whose engine weights are wrong (a partial sync, a bad load), while
the HF reference and the trainer keep the true ones. `rlcheck localize` should name layer K, at the
first position, for every request. Layers below K stay bit-for-bit what they were.
"""

from __future__ import annotations

from typing import Any

from rlcheck.engines.layers import decoder_layers
from rlcheck.errors import ConfigError

PERTURB_FACTOR = 1.01
"""What perturb-layer multiplies layer K's output projection by (1%: far over float32 noise, ~1e-6
relative per layer, and under bfloat16's, ~1e-2)."""

MIXERS = (("self_attn", "o_proj", "attention"), ("mamba", "out_proj", "mamba"), ("mixer", "out_proj", "mamba"))
"""(attribute of the decoder layer, its output projection, layer type): the token mixers of vLLM's and
HF's Llama, Mamba2 and GraniteMoeHybrid layers, which name them alike."""


def output_projection(layer: Any) -> tuple[str, str | None, Any]:
    """(layer type, projection name, module) of a decoder layer's token mixer: ("attention",
    "self_attn.o_proj", ...), ("mamba", "mamba.out_proj" or "mixer.out_proj", ...); a layer without
    a mixer is ("moe" or "mlp", None, None)."""
    for attr, proj, kind in MIXERS:
        module = getattr(getattr(layer, attr, None), proj, None)
        if module is not None:
            return kind, f"{attr}.{proj}", module
    moe = any(getattr(layer, a, None) is not None for a in ("block_sparse_moe", "moe", "experts"))
    return ("moe" if moe else "mlp"), None, None


def _scale_output(model: Any, index: int, factor: float) -> str:
    """Hook decoder layer `index`'s output projection to return `factor` x its output (once: a hook
    already there is kept); returns what it hooked. Runs inside the engine (`LLM.apply_model`)."""
    layers = decoder_layers(model)
    if not 0 <= index < len(layers):
        raise ConfigError(f"perturb-layer={index}: the model has decoder layers 0..{len(layers) - 1}")
    kind, name, proj = output_projection(layers[index])
    if proj is None:
        raise ConfigError(f"perturb-layer={index}: decoder layer {index} ({kind}) has no output projection")

    def scaled(module: Any, args: Any, out: Any) -> Any:
        y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        bias = getattr(module, "bias", None)
        if bias is not None and not getattr(module, "skip_bias_add", False):
            y = (y - bias) * factor + bias  # only the weight's part is scaled
        else:
            y = y * factor
        return y if rest is None else (y, *rest)

    if getattr(proj, "_rlcheck_perturb", None) is None:
        proj._rlcheck_perturb = proj.register_forward_hook(scaled)
    return f"decoder layer {index} ({kind}) {name}"


def scale_output(model: Any, index: int, factor: float = PERTURB_FACTOR) -> str:
    """perturb-layer on a model already in hand (inside a vLLM worker: `rlcheck.engines.vllm_plugin`)."""
    return _scale_output(model, index, factor)


def _unscale_output(model: Any, index: int) -> None:
    _, _, proj = output_projection(decoder_layers(model)[index])
    hook = getattr(proj, "_rlcheck_perturb", None)
    if hook is not None:
        hook.remove()
        del proj._rlcheck_perturb


class PerturbHandle:
    """perturb-layer on one engine. The projection's output is scaled by a forward hook, which is the
    same as scaling its weight (the projections of these models have no bias; with one, only the
    weight's part is scaled): vLLM's CPU linear layers run on a prepacked copy of the weight (oneDNN)
    and drop `weight` itself after loading, so an in-place scale of it would never reach the kernel.
    On a `VLLMEngine` the handle wraps that instance's `sync_weights` (`rlcheck.engines.sync_wraps`, no
    class patched) and applies the perturbation again after every sync, so a reload cannot undo it."""

    def __init__(self, engine: Any, layer: int, factor: float):
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ConfigError(f"perturb-layer needs a decoder layer index >= 0, got {layer!r}")
        self.engine, self.layer, self.factor, self.syncs = engine, layer, factor, 0
        if self.llm is None:
            raise ConfigError("the engine is closed")
        self.target = self.apply()
        self.wrap = None  # a bare vllm.LLM is never synced
        if getattr(engine, "sync_weights", None) is not None:
            from rlcheck.engines.sync_wraps import wrap_sync

            self.wrap = wrap_sync(engine, self._around)

    @property
    def llm(self) -> Any:
        """The engine's `vllm.LLM` (None once closed), never held here: a handle left on a closed engine
        must not keep its LLM alive past `close()` (freed later by the garbage collector, it tore vLLM's
        model-parallel state down under the next in-process engine's start)."""
        return getattr(self.engine, "llm", self.engine)

    def apply(self) -> str:
        """(Re)install the scaling (idempotent); what it scales, as words."""
        layer, factor = self.layer, self.factor
        return self.llm.apply_model(lambda model: _scale_output(model, layer, factor))[0]

    def _around(self, sync: Any, named_tensors: Any, version: int) -> Any:
        out = sync(named_tensors, version)
        self.apply()
        self.syncs += 1
        return out

    def remove(self) -> None:
        """Undo the scaling and the wrap (idempotent)."""
        if self.wrap is not None:
            self.wrap.remove()
        if getattr(self.engine, "llm", self.engine) is not None:  # a closed engine has nothing to undo
            layer = self.layer
            self.llm.apply_model(lambda model: _unscale_output(model, layer))

    def __enter__(self) -> PerturbHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
