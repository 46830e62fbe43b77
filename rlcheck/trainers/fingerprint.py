"""The trainer's side of the sync check (`rlcheck.core.sync_check`): this rank's part of the fingerprint
of the weights it trains, as the engine should hold them (rounded to the engine's dtype, Mamba's A_log
as -exp(A_log)). Each rank reads only what it holds, and the parts add up to the whole:

- one process, or ZeRO 1/2 (every rank holds every weight): rank 0 reads everything, the others nothing;
- FSDP2: each rank its `DTensor` shards (rows of every weight, so the probed columns are all there);
- ZeRO-3: each rank its flat partition `ds_tensor`, positions mapped back to (row, column).

    part = module_fingerprint(model, torch.bfloat16, sharding="fsdp2")   # per rank; merge_fingerprints(parts)
"""

from __future__ import annotations

import time

import torch

from rlcheck.core.sync_check import LAYER_RE, layer_key, probe_columns
from rlcheck.engines.fingerprint import add_stats, order_weights

SHARDINGS = ("none", "fsdp2", "zero3")


def linear_weights(model: torch.nn.Module) -> set[str]:
    """Names of the weights the engine probes as linear layers: every nn.Linear inside a decoder layer,
    and every MoE router (`mlp.gate`, HF's Qwen3-MoE `TopKRouter` holds a bare (experts, hidden) weight;
    vLLM's `GateLinear` is a linear layer)."""
    return {f"{n}.weight" for n, m in model.named_modules()
            if (isinstance(m, torch.nn.Linear) or _is_router(n, m)) and layer_key(n + ".").isdigit()}


def _is_router(name: str, module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return name.endswith("mlp.gate") and isinstance(weight, torch.nn.Parameter) and weight.dim() == 2


def as_engine_holds(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as vLLM stores it after loading: Mamba's A_log becomes A = -exp(A_log) (in float32, as its
    weight loader computes it), everything rounded to the engine's dtype."""
    if name.endswith("A_log"):
        t = -torch.exp(t.float())
    return t.to(dtype)


def module_fingerprint(model: torch.nn.Module, dtype: torch.dtype, *, sharding: str = "none",
                       rank: int = 0, world_size: int = 1) -> dict[str, list[float]]:
    """This rank's part of the fingerprint of `model` (HF names) for an engine computing in `dtype`."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    fp: dict[str, list[float]] = {}
    if sharding == "none" and rank != 0:
        return fp
    if sharding == "fsdp2":
        reshard(model)
    linear = linear_weights(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if sharding == "zero3":
                values, cols, rows = _zero3_part(p, name in linear, rank)
            else:
                values = p.to_local() if hasattr(p, "to_local") else p
                cols = values.detach()[:, probe_columns(values.shape[1])] if name in linear else None
                rows = None if cols is None else torch.arange(cols.shape[0], device=cols.device) + row_offset(p)
            _add_tensor(fp, name, values, cols, dtype, rows)
    return fp


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 module of `model` back on its shards. FSDP2's root does not reshard after its forward
    (the backward would gather it again): after a forward without a backward (a recompute or a probe whose
    step then halted) its parameters (embed, head, final norm) are whole on every rank, and the ranks'
    parts would add up to world_size times them (the next run's start check named embed and head)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def row_offset(p: torch.Tensor) -> int:
    """The first row of this rank's part of `p` (an FSDP2 `DTensor` shard of rows; 0 for a whole tensor),
    from the public DTensor API: each `Shard(0)` placement, in mesh-dimension order, splits the rows
    left by the ones before it as `torch.chunk` does (`Shard.local_shard_size_and_offset`)."""
    if not hasattr(p, "device_mesh"):
        return 0
    from torch.distributed.tensor import Shard

    mesh, rows, offset = p.device_mesh, int(p.shape[0]), 0
    for dim, placement in enumerate(p.placements):
        if placement.is_shard(0):
            rows, start = Shard.local_shard_size_and_offset(rows, mesh.size(dim), mesh.get_local_rank(dim))
            offset += int(start)
    return offset


def stream_fingerprint(named, dtype: torch.dtype, linear_tails: set[str]) -> dict[str, list[float]]:
    """The fingerprint of full (gathered) tensors as a sync streams them, e.g. TRL's
    `_iter_named_params()`; `linear_tails`: `linear_tails(model)`, how the linear weights' names end."""
    fp: dict[str, list[float]] = {}
    for _ in fingerprinting(named, fp, dtype, linear_tails):
        pass
    return fp


def fingerprinting(named, fp: dict[str, list[float]], dtype: torch.dtype, linear_tails: set[str],
                   clock: list[float] | None = None):
    """The (name, tensor) pairs of `named`, each added to `fp` as it passes (`stream_fingerprint` of a
    sync's own stream: no second pass over, or gather of, the weights); `clock[0]` gets the seconds
    it spent."""
    for name, t in named:
        t0 = time.perf_counter()
        with torch.no_grad():
            linear = layer_key(name).isdigit() and tail_of(name) in linear_tails
            cols = t.detach()[:, probe_columns(t.shape[1])] if linear else None
            rows = None if cols is None else torch.arange(cols.shape[0], device=cols.device)
            _add_tensor(fp, name, t, cols, dtype, rows)
        if clock is not None:
            clock[0] += time.perf_counter() - t0
        yield name, t


def _add_tensor(fp: dict[str, list[float]], name: str, values: torch.Tensor, cols: torch.Tensor | None,
                dtype: torch.dtype, rows: torch.Tensor | None = None) -> None:
    """One tensor's share of the fingerprint: its probed columns (`cols`, a linear weight, `rows` the
    row of each of them in the whole tensor) or all its values, and a Mamba conv weight once more for
    the mixer's derived `conv_weights` buffer."""
    key = layer_key(name)
    if cols is not None:
        order = order_weights(name.rsplit(".", 2)[-2], rows)
        add_stats(fp, key + ":linear", as_engine_holds(name, cols, dtype), order.view(-1, *([1] * (cols.dim() - 1))))
        return
    values = as_engine_holds(name, values.detach().reshape(-1), dtype)
    add_stats(fp, key + ":params", values)
    if name.endswith("conv1d.weight"):
        add_stats(fp, key + ":buffers", values)


def tail_of(name: str) -> str:
    """What follows "layers.N." in a tensor's name ("self_attn.q_proj.weight"); the name outside the layers."""
    m = LAYER_RE.search(name)
    return name[m.end():] if m else name


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "modules_to_save.default.")
"""What activation checkpointing, FSDP1 and PEFT's modules_to_save put into names; TRL drops them."""


def streamed_name(name: str) -> str | None:
    """A trainer-side name as TRL 1.16's `_iter_named_params` streams it to vLLM: PEFT's
    `base_model.model.` and `.base_layer` and the wrappers' prefixes removed; None for what TRL does not
    stream (LoRA's own `lora_*` tensors, merged into the base weight, and `original_module`)."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if ".lora_" in name or "original_module" in name:
        return None
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def linear_tails(model: torch.nn.Module) -> set[str]:
    """How the linear weights' names end under the names TRL streams (a LoRA model's
    `q_proj.base_layer.weight` is streamed, merged, as `q_proj.weight`)."""
    return {tail_of(n) for n in map(streamed_name, linear_weights(model)) if n is not None}


def _zero3_part(p: torch.Tensor, is_linear: bool, rank: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                      torch.Tensor | None]:
    """This rank's elements of a ZeRO-3 parameter (its partition less the padding) and, for a linear
    weight, those of them in the probed columns with the row of each."""
    part = p.ds_tensor.detach().reshape(-1)
    size = part.numel()
    start = rank * size
    valid = max(0, min(p.ds_numel - start, size))
    part = part[:valid]
    if not is_linear:
        return part, None, None
    k = p.ds_shape[-1]
    rows = torch.arange(start // k, (start + valid + k - 1) // k, device=part.device)
    flat = (rows[:, None] * k + torch.tensor(probe_columns(k), device=part.device)[None, :]).reshape(-1) - start
    held = (flat >= 0) & (flat < valid)
    return part, part[flat[held]], (flat[held] + start) // k
