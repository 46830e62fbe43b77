"""Repairs a vLLM engine needs after `reload_weights`: the Mamba conv weights on the CPU backend.

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    refresh_mamba_conv_weights(llm)       # -> how many Mamba mixers it had to refresh (0: none stale)

Why (vLLM 0.32, CPU backend, bf16; the whole case in docs/mamba-conv-sync.md): `MambaMixer2` keeps
`conv_weights`, a non-persistent buffer that views `conv1d.weight`, and the CPU conv reads that buffer.
On CPUs with AVX512-BF16 (or ARM with bf16) loading repacks a bf16 `conv1d.weight` into new storage
and stashes the plain (dim, width) copy in `conv1d._cpu_unpacked_conv_weight`, so the buffer no longer
aliases the parameter. `reload_weights` then re-packs the new weights but puts the old buffer back:
the conv keeps running on the weights of the first load. On AVX2-only CPUs nothing is packed, the
buffer still aliases the parameter, and there is nothing to repair (the refresh counts 0).

Checking this without such a CPU: `simulated_conv_pack()` makes vLLM run its packing on any CPU (a
pure-torch stand-in for the pack op), so an AVX2 machine goes down the AVX512-BF16 load and reload path.
Only that context manager imports vllm; the rest reads the model's modules by their attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

UNPACKED_ATTR = "_cpu_unpacked_conv_weight"  # set by vLLM's dispatch_cpu_unquantized_gemm when it packs


def conv_weights_source(conv1d: Any):
    """The (dim, width) weights the conv should run on: vLLM's unpacked copy when it packed
    `conv1d.weight`, otherwise a view of `conv1d.weight` itself ((dim, 1, width) in vLLM's layout)."""
    unpacked = getattr(conv1d, UNPACKED_ATTR, None)
    if unpacked is not None:
        return unpacked
    w = conv1d.weight
    return w.view(w.size(0), w.size(2)) if w.dim() == 3 else w


def conv_mixers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every module holding a `conv_weights` buffer beside a `conv1d` layer (vLLM's
    MambaMixer2, used by Mamba2, Granite 4 / GraniteMoeHybrid, Nemotron-H, Zamba2, ...)."""
    return [
        (name, m) for name, m in model.named_modules()
        if "conv_weights" in getattr(m, "_buffers", {}) and hasattr(getattr(m, "conv1d", None), "weight")
    ]


def is_stale(name: str, mixer: Any) -> bool:
    """True when the mixer's conv buffer holds other values than the weights its conv should use
    (False while it still aliases them, as on AVX2-only CPUs)."""
    import torch

    buf, src = mixer.conv_weights, conv_weights_source(mixer.conv1d)
    if buf.shape != src.shape:
        raise RuntimeError(
            f"{name}.conv_weights {tuple(buf.shape)} does not match its conv1d weights {tuple(src.shape)}: "
            "this vLLM lays Mamba conv weights out differently (docs/mamba-conv-sync.md, 'Another vLLM version')"
        )
    return buf.data_ptr() != src.data_ptr() and not torch.equal(buf, src.to(buf.dtype))


def count_conv_mixers(model: Any) -> int:
    """How many Mamba mixers with a conv buffer `model` has (runs inside each worker)."""
    return len(conv_mixers(model))


def stale_conv_mixers(model: Any) -> list[str]:
    """Names of the mixers whose conv runs on other weights than the loaded ones. Runs inside the
    engine: `llm.apply_model(stale_conv_mixers)` (one list per worker)."""
    return [name for name, mixer in conv_mixers(model) if is_stale(name, mixer)]


def refresh_conv_weights(model: Any) -> int:
    """Copy, in place, the weights each stale mixer's conv should use into its `conv_weights` buffer
    (in place: whatever holds the buffer sees the new values); returns how many it copied. Runs
    inside the engine, on each worker's model (`llm.apply_model`)."""
    import torch

    refreshed = 0
    with torch.no_grad():
        for name, mixer in conv_mixers(model):
            if is_stale(name, mixer):
                mixer.conv_weights.copy_(conv_weights_source(mixer.conv1d))
                refreshed += 1
    return refreshed


def refresh_mamba_conv_weights(llm: Any) -> int:
    """After `reload_weights` into `llm` (a `vllm.LLM`): bring every Mamba mixer's conv buffer to the
    weights just loaded; returns the number of mixers refreshed over all workers (0 where nothing was
    stale: AVX2-only CPUs, fp32, GPUs, models without Mamba layers)."""
    return int(sum(llm.apply_model(refresh_conv_weights)))


def pack_standin(unpacked):
    """Stands in for vLLM's `causal_conv1d_weight_pack` (a C++ op built only for AVX512-BF16 and ARM
    bf16): (dim, width) -> a new tensor in another layout, pairs of taps interleaved per channel,
    (width // 2, dim, 2), as a VNNI-style pack does. Its exact layout does not matter here: what it
    shares with the real op is new storage that nothing reads as (dim, width) weights."""
    dim, width = unpacked.shape
    return unpacked.reshape(dim, width // 2, 2).transpose(0, 1).contiguous()


@contextlib.contextmanager
def simulated_conv_pack() -> Iterator[None]:
    """Within it, engines built and reloaded in this process pack their bf16 Mamba conv weights as on
    an AVX512-BF16 CPU: vLLM's own `dispatch_cpu_unquantized_gemm` runs with
    `torch.cpu._is_avx512_bf16_supported` answering True, and `pack_standin` as the pack op. Only that
    function sees the patched answer, so the rest of vLLM (kernel library, attention and Mamba state
    layout) keeps to what this CPU really has. Needs in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    import torch
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    real_dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight):
        real_check = torch.cpu._is_avx512_bf16_supported
        torch.cpu._is_avx512_bf16_supported = lambda: True
        try:
            return real_dispatch(layer, remove_weight)
        finally:
            torch.cpu._is_avx512_bf16_supported = real_check

    real_pack = getattr(ops, "causal_conv1d_weight_pack", None)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    ops.causal_conv1d_weight_pack = pack_standin
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = real_dispatch
        if real_pack is None:
            del ops.causal_conv1d_weight_pack
        else:
            ops.causal_conv1d_weight_pack = real_pack


class StaleConvBuffers:
    """The `stale-buffer` fault (a self-test of the sync check): after every `sync_weights` of one
    engine, each Mamba mixer's `conv_weights` buffer holds the values it had before the sync, in
    storage of its own, as on an AVX512-BF16 CPU without the refresh, in any dtype and on any CPU.
    Each worker keeps its own buffers (under tensor parallelism, its own shard of them) inside its own
    process until the sync is done. A wrap of that engine instance's `sync_weights`
    (`rlcheck.engines.sync_wraps`; no class is patched); `remove()` undoes it."""

    def __init__(self, engine: Any):
        from rlcheck.engines.sync_wraps import wrap_sync

        self.engine = engine
        if not sum(engine.llm.apply_model(count_conv_mixers)):  # a module function: TP workers unpickle it
            from rlcheck.errors import ConfigError

            raise ConfigError("stale-buffer needs a model with Mamba2 mixers (mamba2, hybrid)")
        self.wrap = wrap_sync(engine, self._around)
        self.syncs = 0

    def _around(self, sync: Any, named_tensors: Any, version: int) -> None:
        self.engine.llm.apply_model(_stash_conv_buffers)
        sync(named_tensors, version)
        self.engine.llm.apply_model(_restore_conv_buffers)
        self.syncs += 1

    def remove(self) -> None:
        self.wrap.remove()


STASH_ATTR = "_rlcheck_stale_conv_buffers"


def _stash_conv_buffers(model: Any) -> int:
    """Keep a copy of this worker's conv buffers on its model (runs inside each worker)."""
    setattr(model, STASH_ATTR, conv_buffers(model))
    return len(getattr(model, STASH_ATTR))


def _restore_conv_buffers(model: Any) -> int:
    """Put this worker's stashed conv buffers back, in storage of their own: the conv reads them, the
    reload does not reach them (runs inside each worker)."""
    return restore_conv_buffers(model, model.__dict__.pop(STASH_ATTR))


def conv_buffers(model: Any) -> dict[str, Any]:
    """A copy of every Mamba mixer's conv_weights buffer, by mixer name (runs inside the engine)."""
    return {name: mixer.conv_weights.detach().clone() for name, mixer in conv_mixers(model)}


def restore_conv_buffers(model: Any, old: dict[str, Any]) -> int:
    """Put `conv_buffers`' copies back, each in storage of its own (the stale-buffer fault); how many."""
    for name, mixer in conv_mixers(model):
        mixer.conv_weights = old[name]
    return len(old)


def keep_conv_buffers_stale(engine: Any) -> StaleConvBuffers:
    """Install the `stale-buffer` fault on a `VLLMEngine` (see `StaleConvBuffers`)."""
    return StaleConvBuffers(engine)


def prepack_moe_on_reload(model: Any) -> int:
    """Make every MoE layer whose CPU kernel prepacks its expert weights prepack them again on a
    weight update; returns how many layers it fixed. vLLM 0.32's unquantized MoE method prepacks
    (and pads) the experts' weights for the CPU grouped GEMM only on the first load
    (`UnquantizedFusedMoEMethod._setup_kernel` skips `fused_experts.process_weights_after_loading`
    on an update), so after `reload_weights` the kernel reads the new weights, unpacked, as if
    packed: every expert computes garbage and nothing fails (tests/integration/test_moe_routing.py).
    The fix runs that step on updates too, inside the layerwise reload, before the processed values
    are copied into the kernel's storage. Runs inside the engine, once after the first load
    (`llm.apply_model`); a no-op on GPUs, zentorch, models without MoE layers, and a second call."""
    fixed = 0
    for method in prepacked_moe_methods(model):
        if not getattr(method, "rlcheck_prepacks_updates", False):
            method._setup_kernel = _prepacking_setup(method, method._setup_kernel)
            method.rlcheck_prepacks_updates = True
            fixed += 1
    return fixed


def prepacked_moe_methods(model: Any) -> list[Any]:
    """The MoE layers' methods whose CPU kernel prepacks the experts' weights (vLLM 0.32's CPU
    unquantized experts; not zentorch, which keeps them as loaded). Runs inside the engine."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another vLLM layout: nothing of this kind
        return []
    out = []
    for _, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            out.append(method)
    return out


def has_prepacked_moe(model: Any) -> bool:
    """Whether `model` (inside the engine) has MoE layers with prepacked CPU expert weights, which
    only `reload_weights` with `prepack_moe_on_reload` can update (a plain `load_weights` writes the
    new weights, unpacked, into the packed storage)."""
    return bool(prepacked_moe_methods(model))


def _prepacking_setup(method: Any, setup: Any):
    """`setup` (a bound `_setup_kernel`), then the experts' pad-and-prepack on the reloaded layer."""

    def setup_kernel(layer: Any, w13: Any, w2: Any) -> None:
        setup(layer=layer, w13=w13, w2=w2)
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return setup_kernel
