"""What the engine guard reads from vLLM 0.32's model runner (paths under site-packages/vllm):

- the batch, in the row order the kernels see: `input_batch.req_ids[:num_reqs]`,
  `num_computed_tokens_cpu` (tokens computed before the step, set in `_update_states`,
  v1/worker/gpu_model_runner.py:1172) and `num_prompt_tokens` (v1/worker/gpu_input_batch.py:156-169);
  tokens scheduled per request and the new / resumed / finished ids from the `SchedulerOutput`
  (v1/core/sched/output.py:232: num_scheduled_tokens, scheduled_new_reqs, scheduled_cached_reqs
  .resumed_req_ids, finished_req_ids);
- what the Mamba kernels are told, from the forward context's metadata (forward_context.py:144) as
  `_model_forward` runs (gpu_model_runner.py:4189-4213), i.e. after any rewrite of the metadata
  (an injected fault's): `num_decodes`, `state_indices_tensor_d` (decode rows first),
  `state_indices_tensor_p` and `has_initial_states_p` (v1/attention/backends/mamba_attn.py:30-50,
  computed at :482-512);
- what the scheduler assigned: the block table rows (v1/worker/block_table.py:80-83,
  `block_table.np`, `num_blocks_per_row`); in "align" mode the current block is column
  (seq_len - 1) // block_size, as `mamba_get_block_table_tensor` gathers it
  (v1/attention/backends/utils.py:1163);
- the pool: `kv_cache_config.num_blocks` and each layer's cache tensors
  (`compilation_config.static_forward_context[layer].kv_cache`), whose block dimension's stride is
  what a kernel multiplies a slot by.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rlcheck.core.run.guard_files import row_of
from rlcheck.core.run.guard_record import GroupOffsets, PoolInfo, Ragged, StepRecord, Violation
from rlcheck.engines.vllm_faults import external_id

MAX_LIST = 4096  # items of a list, or values of a tensor, a snapshot writes out
MAX_DEPTH = 8


class Layout(NamedTuple):
    """The engine's KV groups: Mamba ones (group id, a layer name, block size) and attention ones."""

    mamba: tuple[tuple[int, str, int], ...]
    attention: tuple[int, ...]
    mode: str  # cache_config.mamba_cache_mode: "none" (one slot per request) or "align"


def layout(runner: Any) -> Layout:
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba, attention = [], []
    for gid, g in enumerate(runner.kv_cache_config.kv_cache_groups):
        if isinstance(g.kv_cache_spec, MambaSpec):
            mamba.append((gid, g.layer_names[0], int(g.kv_cache_spec.block_size)))
        elif g.layer_names:
            attention.append(gid)
    return Layout(tuple(mamba), tuple(attention), str(runner.cache_config.mamba_cache_mode))


def _tensors(kv: Any) -> list[Any]:
    if isinstance(kv, (list, tuple)):
        return [t for x in kv for t in _tensors(x)]
    return [kv] if hasattr(kv, "stride") else []


def _addressing(t: Any, num_blocks: int, layer: str) -> GroupOffsets | None:
    """Stride of the block dimension (the first of size num_blocks) and the extent of one slot."""
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        return None
    d = dims[0]
    extent = 1 + sum((n - 1) * s for i, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)) if i != d)
    return GroupOffsets(int(t.stride(d)), int(extent), int(t.element_size()), layer)


def pool_info(runner: Any) -> PoolInfo:
    """The pool size and, per KV group, the addressing of its worst cache tensor (largest end offset);
    the groups none of whose tensors has a dimension of num_blocks, for check (iv) to say it did not run."""
    num_blocks = int(runner.kv_cache_config.num_blocks)
    ctx = runner.compilation_config.static_forward_context
    offsets: dict[int, GroupOffsets] = {}
    groups = runner.kv_cache_config.kv_cache_groups
    for gid, g in enumerate(groups):
        for name in g.layer_names:
            layer = ctx.get(name)
            for t in _tensors(getattr(layer, "kv_cache", None)):
                o = _addressing(t, num_blocks, name)
                best = offsets.get(gid)
                if o is not None and (best is None or o.end_offset(num_blocks - 1) > best.end_offset(num_blocks - 1)):
                    offsets[gid] = o
    return PoolInfo(num_blocks, offsets, tuple(g for g in range(len(groups)) if g not in offsets))


class StepReader:
    """Turns the runner's state at `_model_forward` into a `StepRecord`; remembers the external id of
    every live internal request id ("{id}-{8 random characters}")."""

    def __init__(self, runner: Any, lay: Layout):
        self.runner, self.layout = runner, lay
        self._ids: dict[str, str] = {}

    def external(self, internal: str) -> str:
        rid = self._ids.get(internal)
        if rid is None:
            rid = self._ids[internal] = external_id(internal)
        return rid

    def forget(self, internal: str) -> str:
        """The external id of a finished request, no longer remembered."""
        return self._ids.pop(internal, None) or external_id(internal)

    def read(self, step: int, sched: Any, metadata: dict[str, Any], call_step: int | None) -> StepRecord:
        ib = self.runner.input_batch
        n = int(ib.num_reqs)
        internal = ib.req_ids[:n]
        computed = ib.num_computed_tokens_cpu[:n].astype(np.int64)
        tokens = sched.num_scheduled_tokens
        scheduled = np.array([tokens[r] for r in internal], dtype=np.int64)
        admitted = {r.req_id for r in sched.scheduled_new_reqs} | set(sched.scheduled_cached_reqs.resumed_req_ids)
        finished = tuple(self.forget(r) for r in sched.finished_req_ids)
        mamba = self._mamba(metadata, n, computed + scheduled)
        ids = self._ids
        return StepRecord(
            step=step, request_ids=tuple([ids.get(r) or self.external(r) for r in internal]), computed=computed,
            scheduled=scheduled, prompt_len=ib.num_prompt_tokens[:n].astype(np.int64),
            new=np.array([r in admitted for r in internal], dtype=bool),
            groups=tuple(g for g, _, _ in self.layout.mamba), **mamba,
            attn_groups=self.layout.attention, blocks=tuple(self._rows(g, n) for g in self.layout.attention),
            finished=finished, call_step=call_step)

    def _mamba(self, metadata: dict[str, Any], n: int, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        num_groups = len(self.layout.mamba)
        slot = np.zeros((n, num_groups), dtype=np.int64)
        assigned = np.zeros((n, num_groups), dtype=np.int64)
        decode = np.zeros((n, num_groups), dtype=bool)
        initial = np.zeros((n, num_groups), dtype=bool)
        for g, (gid, layer, block_size) in enumerate(self.layout.mamba):
            md = metadata[layer]
            nd, npf = int(md.num_decodes), int(md.num_prefills)
            if nd:
                slot[:nd, g] = _np(md.state_indices_tensor_d)[:nd, 0]
                decode[:nd, g] = initial[:nd, g] = True
            if npf:
                slot[nd:nd + npf, g] = _np(md.state_indices_tensor_p)[:npf]
                initial[nd:nd + npf, g] = _np(md.has_initial_states_p)[:npf]
            table = self.runner.input_batch.block_table[gid].block_table.np[:n]
            col = 0 if self.layout.mode == "none" else np.maximum((seq_lens - 1) // block_size, 0)
            assigned[:, g] = table[np.arange(n), col]
        return {"slot": slot, "assigned": assigned, "decode": decode, "initial_state": initial}

    def _rows(self, gid: int, n: int) -> Ragged:
        bt = self.runner.input_batch.block_table[gid]
        counts = bt.num_blocks_per_row[:n].astype(np.int64)
        table = bt.block_table.np[:n]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return Ragged(table[np.arange(table.shape[1])[None, :] < counts[:, None]].astype(np.int64), offsets)


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()


# ---- break snapshots ---------------------------------------------------------------------------


def to_json(x: Any, depth: int = 0) -> Any:
    """A JSON-able copy of vLLM objects (dataclasses, msgspec structs, tensors, sets, enums), lists
    and tensors cut at MAX_LIST values, anything else as its repr; never pickled."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if np.isfinite(x) else str(x)
    if depth > MAX_DEPTH:
        return repr(x)[:200]
    if isinstance(x, enum.Enum):
        return x.name
    if hasattr(x, "detach") and hasattr(x, "shape"):  # torch.Tensor
        return _array(_np(x), str(x.dtype))
    if isinstance(x, np.ndarray):
        return _array(x, str(x.dtype))
    if isinstance(x, np.generic):
        return to_json(x.item())
    if isinstance(x, dict):
        return {str(k): to_json(v, depth + 1) for k, v in list(x.items())[:MAX_LIST]}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x, key=str) if isinstance(x, (set, frozenset)) else list(x)
        return [to_json(v, depth + 1) for v in items[:MAX_LIST]]
    names = _fields(x)
    if names is not None:
        return {"__type__": type(x).__name__, **{k: to_json(getattr(x, k, None), depth + 1) for k in names}}
    return repr(x)[:500]


def _fields(x: Any) -> list[str] | None:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [f.name for f in dataclasses.fields(x)]
    struct = getattr(type(x), "__struct_fields__", None)  # msgspec.Struct (SamplingParams)
    return list(struct) if struct is not None else None


def _array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    flat = a.reshape(-1)
    out = {"dtype": dtype, "shape": list(a.shape), "values": flat[:MAX_LIST].tolist()}
    if flat.size > MAX_LIST:
        out["truncated"] = True
    return out


def metadata_json(metadata: dict[str, Any]) -> dict[str, Any]:
    """The step's attention / Mamba metadata, one entry per distinct object with the layers sharing it."""
    seen: dict[int, dict[str, Any]] = {}
    for name, md in metadata.items():
        entry = seen.get(id(md))
        if entry is None:
            seen[id(md)] = {"layers": [name], "metadata": to_json(md)}
        else:
            entry["layers"].append(name)
    return {entry["layers"][0]: entry for entry in seen.values()}


def write_snapshot(path: Path, rec: StepRecord, i: int, scheduler_output: Any, metadata: dict[str, Any],
                   found: list[Violation], pool: dict[str, Any]) -> None:
    """The break snapshot of row `i` of a step: the request as the guard saw it, the step's
    violations naming it, the batch, the scheduler output and the metadata, as JSON."""
    rid = rec.request_ids[i]
    snapshot = {"request_id": rid, "step": rec.step, "call_step": rec.call_step, "request": row_of(rec, i),
                "violations": [v.to_dict() for v in found if v.request_id == rid],
                "batch": {"request_ids": list(rec.request_ids), "finished": list(rec.finished)},
                "scheduler_output": to_json(scheduler_output), "metadata": metadata_json(metadata), "pool": pool}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(snapshot, indent=1, default=str), encoding="utf-8")
