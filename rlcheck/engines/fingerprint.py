"""The engine's side of the sync check (`rlcheck.core.sync_check`): a fingerprint, per decoder layer, of
the weights a vLLM model computes with, taken inside its worker.

    engine_fp = llm.apply_model(engine_fingerprint)[0]     # {"3:linear": (sum, sumsq, l1, ordered), ...}

Linear layers are probed with one-hot rows through their own forward (or, with a bias, their
`quant_method.apply` without it), so the numbers come from whatever the engine really multiplies with: on vLLM's CPU backend the weights of a linear
layer are handed to oneDNN (or packed) after loading and the parameter left empty; on GPUs it is the
parameter itself. Mamba conv layers (a linear class holding a 3-D weight) are read as parameters.
`add_stats` and `order_weights` are shared with the trainer's side (`rlcheck.trainers.fingerprint`):
a linear layer's probe outputs are also summed weighted by their output row (its row in the
checkpoint's tensor, `_row_order`), so rows a sync permuted are seen, which plain sums are blind to.

Tensor parallel engines: every worker fingerprints its shard and `fingerprint_llm` adds them up. A
column-parallel layer is probed at the same input columns on every worker (each holds some of the
outputs); a row-parallel one at the probe columns that fall in the worker's part of the input (each
holds every output of its columns), through `quant_method.apply`, never the forward's all-reduce. What
every worker holds whole (norms, a row-parallel bias, key/value heads replicated when there are fewer
than workers) is counted by one worker only, so the sums are those of the unsharded model.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from rlcheck.core.sync_check import layer_key, merge_fingerprints, probe_columns

DERIVED_BUFFERS = ("conv_weights",)
"""Buffers computed from the weights at load (Mamba mixers' conv weights), checked against their source."""


ORDER_PRIME, ORDER_MOD = 2654435761, 1 << 31
CHUNK = 1 << 24
"""Elements per float64 pass over a parameter: 128 MiB, never a float64 copy of a whole embedding."""


def add_stats(fp: dict[str, list[float]], key: str, t: torch.Tensor, order: torch.Tensor | None = None) -> None:
    """Add t's (sum, sum of squares, sum of |x|, order-weighted sum), in float64, to fp[key]. `order`:
    the weights of t's output rows (`order_weights`, broadcast against t); None: the key's order
    component is not compared (NaN), as for parameters an engine may hold in a backend's layout."""
    acc = fp.setdefault(key, [0.0, 0.0, 0.0, 0.0])
    if order is None:
        acc[3] = float("nan")
    else:
        acc[3] += float((t.detach().double() * order).sum())
    for part in t.detach().reshape(-1).split(CHUNK):
        d = part.double()
        acc[0] += float(d.sum())
        acc[1] += float((d * d).sum())
        acc[2] += float(d.abs().sum())


def order_weights(part: str, rows: torch.Tensor) -> torch.Tensor:
    """(R,) float64 weights in [-0.5, 0.5) of the output rows `rows` (int64, their index in the
    checkpoint's tensor) of the linear weight whose last name is `part` ("q_proj"): an integer hash,
    exact on any device, so both sides weigh a row alike and a permutation of rows (or a swap of two
    parts of a fused layer) changes the weighted sum."""
    h = zlib.crc32(part.encode())
    return ((rows.to(torch.int64) * ORDER_PRIME + h) % ORDER_MOD).double() / ORDER_MOD - 0.5


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the engine computes in (its embeddings')."""
    return next(t.dtype for n, t in model.named_parameters() if "embed" in n)


def _probed_linear(name: str, module: Any) -> bool:
    """A linear layer the fingerprint probes; a Mamba conv (a linear class holding the conv weight: 3-D,
    or 2-D where the CPU backend flattened it in bf16) is read as a parameter."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase) and module.weight.dim() != 3 and not name.endswith("conv1d")


def engine_fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """The fingerprint of a vLLM model (runs in its worker: `llm.apply_model(engine_fingerprint)`);
    with tensor parallelism, this worker's share of it."""
    dtype = model_dtype(model)
    fp: dict[str, list[float]] = {}
    probed = set()
    with torch.no_grad():
        for name, m in model.named_modules():
            key = layer_key(name + ".")
            if not key.isdigit() or not _probed_linear(name, m):
                continue
            probed.add(name + ".weight")
            y = _probe(m, dtype)
            if y is not None:
                order = _row_order(model, name, m)
                add_stats(fp, key + ":linear", y.to(dtype), None if order is None else order[: y.shape[1]])
        for name, p in model.named_parameters():
            part = None if name in probed else _counted_part(model, name, p)
            if part is not None:
                add_stats(fp, layer_key(name) + ":params", part.to(dtype))
        for name, b in model.named_buffers():
            if name.rpartition(".")[2] in DERIVED_BUFFERS:
                add_stats(fp, layer_key(name) + ":buffers", b.to(dtype))  # a sharded weight's, sharded with it
    return fp


def _probe(m: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """The layer's outputs at one-hot rows of its probe columns (this worker's share; None: none of them)."""
    cols = probe_columns(m.input_size)
    if getattr(m, "tp_size", 1) == 1:
        return _linear_output(m, _one_hot(cols, m.input_size, dtype, _device(m)))
    part = m.input_size_per_partition
    if part != m.input_size:  # row-parallel: this worker holds inputs [lo, lo + part)
        lo = m.tp_rank * part
        cols = [c - lo for c in cols if lo <= c < lo + part]
        if not cols:
            return None
    y = m.quant_method.apply(m, _one_hot(cols, part, dtype, _device(m)), bias=None)
    return y[:, :_unique_outputs(m)]


def _row_order(model: torch.nn.Module, name: str, m: Any) -> torch.Tensor | None:
    """(outputs,) `order_weights` of this worker's output rows of linear layer `name`, each at its row
    in the checkpoint's tensor: a fused layer's parts (`packed_modules_mapping`: qkv_proj -> q_proj,
    k_proj, v_proj) each under its own name, a column-parallel shard at its offset (replicated key/value
    heads at their head's). None where the rows cannot be placed (a fused layer the checkpoint keeps
    whole, under tensor parallelism)."""
    base = name.rpartition(".")[2]
    sizes = list(getattr(m, "output_sizes", None) or [m.output_size])  # unsharded (kv: x replicas)
    sharded = getattr(m, "output_size_per_partition", m.output_size) != m.output_size  # column-parallel
    parts = getattr(model, "packed_modules_mapping", {}).get(base)
    packed = parts is not None and len(parts) == len(sizes) > 1
    if sharded and len(sizes) > 1 and not packed:
        return None
    tp, rank, replicas = getattr(m, "tp_size", 1), getattr(m, "tp_rank", 0), getattr(m, "num_kv_head_replicas", 1)
    weights, offset = [], 0
    for j, full in enumerate(sizes):
        local = full // tp if sharded else full
        shard = (rank // replicas if j else rank) if sharded else 0  # a QKV layer's k and v: by kv head
        rows = torch.arange(shard * local, (shard + 1) * local) + (0 if packed else offset)
        weights.append(order_weights(parts[j] if packed else base, rows))
        offset += full
    return torch.cat(weights).to(_device(m))


def _one_hot(cols: list[int], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    x = torch.zeros(len(cols), width, dtype=dtype, device=device)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    return x


def _unique_outputs(m: Any) -> int | None:
    """How many of a tensor-parallel layer's outputs this worker counts: all (None) but on a worker
    whose key/value heads another worker also holds (fewer kv heads than workers): its query heads."""
    replicas = getattr(m, "num_kv_head_replicas", 1)
    return m.num_heads * m.head_size if replicas > 1 and m.tp_rank % replicas else None


def _counted_part(model: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor | None:
    """The part of a parameter this worker counts: a shard's own, a whole tensor on the first worker
    only, vLLM's vocabulary padding rows left out."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    tp_size = getattr(owner, "tp_size", 1)
    loader = getattr(getattr(p, "weight_loader", None), "__qualname__", "")
    row_parallel_bias = name.endswith("bias") and getattr(owner, "input_size_per_partition", None) not in (
        None, getattr(owner, "input_size", None))
    sharded = (tp_size > 1 and not row_parallel_bias) or loader.startswith("sharded_weight_loader")
    if not sharded and _tp_rank() != 0:
        return None
    if sharded and tp_size > 1 and name.endswith("bias") and _unique_outputs(owner) is not None:
        p = p[:_unique_outputs(owner)]
    return _rows(owner, p)


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # no parallel state: a single worker
        return 0


def _linear_output(m: Any, x: torch.Tensor) -> torch.Tensor:
    """x through the layer as the engine runs it: its forward (hooks included) when it has no bias,
    else its `quant_method` without the bias (a one-hot row plus a bias would not be exact)."""
    if getattr(m, "bias", None) is None:
        y = m(x)
        return y[0] if isinstance(y, tuple) else y
    return m.quant_method.apply(m, x, bias=None)


def _device(module: Any) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _rows(owner: Any, p: torch.Tensor) -> torch.Tensor:
    """An embedding or LM head without vLLM's vocabulary padding rows (the checkpoint has none)."""
    vocab = getattr(owner, "org_vocab_size", None)
    if getattr(owner, "tp_size", 1) > 1:
        return p  # a shard: its padding rows are zero, adding nothing to the sums
    return p[:vocab] if vocab is not None and p.dim() == 2 and p.size(0) > vocab else p


def whole_fingerprint(model: torch.nn.Module) -> dict[str, tuple[float, float, float]]:
    """The whole model's fingerprint, on every worker (runs in each: `llm.apply_model`): with tensor
    parallelism, every worker's share gathered over vLLM's tensor-parallel group. It also serves where
    each process holds one worker in-process (TRL colocate's `external_launcher`)."""
    part = engine_fingerprint(model)
    group = _tp_group()
    if group is None:
        return merge_fingerprints([part])
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return merge_fingerprints(parts)


def _tp_group() -> Any:
    """vLLM's tensor-parallel process group (its CPU one), None without tensor parallelism."""
    from vllm.distributed.parallel_state import get_tp_group

    try:
        group = get_tp_group()
    except AssertionError:  # no parallel state: a single worker
        return None
    return group.cpu_group if group.world_size > 1 else None


def fingerprint_llm(llm: Any):
    """The fingerprint of the weights a `vllm.LLM` computes with (with tensor parallelism: every
    worker's share, added up). A tensor-parallel engine with vLLM's `mp` executor needs
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` to run the function in its workers (rlcheck's engine sets it)."""
    return llm.apply_model(whole_fingerprint)[0]


def score_tokens(llm: Any, prompts: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
    """The engine's logprob of each response token after its prompt, teacher-forced: a fresh prefill of
    prompt + response (the prefix cache not read), vLLM's prompt logprobs, which are log_softmax of the
    unscaled logits (temperature 1, no logit processor) whatever the sampling settings."""
    from vllm import SamplingParams

    rows = [{"prompt_token_ids": list(map(int, p)) + list(map(int, r))} for p, r in zip(prompts, responses, strict=True)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, skip_reading_prefix_cache=True,
                            detokenize=False)
    outs = llm.generate(rows, params, use_tqdm=False)
    scored = []
    for out, p, r in zip(outs, prompts, responses, strict=True):
        ids = list(p) + list(r)
        scored.append(np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(len(p), len(ids))], dtype=np.float32))
    return scored


def greedy_tokens(llm: Any, prompts: list[list[int]], count: int) -> list[list[int]]:
    """Each prompt's greedy continuation, exactly `count` tokens (end-of-sequence ignored): tokens the
    model finds likely, whose logprobs carry less of a low-precision kernel's error than random ids
    do (the sync check's probe batch scores them)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=count, min_tokens=count, ignore_eos=True, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]
