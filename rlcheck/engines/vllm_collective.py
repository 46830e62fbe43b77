"""Weights from trainer rank 0 into the rollout engines through a collective, in flattened buckets.

    layout = plan_buckets(specs_of(weights), bucket_bytes=512 * 2**20)  # names, shapes, dtypes, offsets
    group = SyncGroup(host, port, rank, world_size, timeout_s, "gloo")  # 0: trainer rank 0, 1..: engines
    send_weights(group, weights, bucket_bytes)                         # on rank 0
    receive_buckets(group, stats)                                      # on each receiver, at the same time

The group is its own: a `torch.distributed.TCPStore` (served by rank 0) and a process group built on it
directly, never `init_process_group`, so the trainer ranks' default group is not touched and the
rollout actor needs none: `ProcessGroupGloo` (buckets in host memory, over TCP) or, on GPUs,
`ProcessGroupNCCL` (buckets on each side's current GPU: rank 0 copies each bucket from its pinned host
weights to the device once, the engine loads from device memory), the same code either way, only the
process group and the buckets' device differ (`BACKENDS`). The same idea as vLLM's
`StatelessProcessGroup` + `PyNcclCommunicator` (vLLM's rlhf example, TRL's vllm_client) and OpenRLHF's
`init_process_group` helper (a named group besides the default one). Rank 0 first broadcasts the layout (JSON: a length, then the bytes), then each
bucket as one uint8 tensor, as verl's and vLLM's packed weight transfer do (vLLM: 1 GB buckets); OpenRLHF
broadcasts tensor by tensor, a round trip per tensor. Each of the engine's workers (every tensor-parallel
one: `rlcheck.engines.vllm_worker_sync`) receives the buckets itself, turns a bucket into views and
loads its shard of it with one `reload_weights` before the next arrives: memory on the engine side is
one bucket per worker, not a copy of the model.

A bucket never splits a decoder layer (`layer_key`): vLLM's layerwise reload processes a layer once per
call, and a layer that got only part of its weights in a call (q_proj without k_proj of a fused
qkv_proj, some experts of a fused MoE) would keep uninitialised memory in the rest. A layer bigger than
the bucket size goes alone, in a bucket of its own size.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from rlcheck.errors import ConfigError, InputError, WeightSyncError

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this in its bucket (a uint8 slice views as any dtype there)."""
DEFAULT_BUCKET_MB = 512
BACKENDS = ("gloo", "nccl")
_LAYER_INDEX = re.compile(r"^(.*?\.\d+)\.")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name: "float32", "bfloat16", ...
    offset: int  # bytes from the bucket's start, a multiple of ALIGN_BYTES
    num_bytes: int


@dataclass(frozen=True)
class BucketLayout:
    """The tensors of one sync, bucket by bucket, in the order rank 0 sends them."""

    buckets: tuple[tuple[TensorSlot, ...], ...]

    def bucket_bytes(self, i: int) -> int:
        last = self.buckets[i][-1]
        return last.offset + last.num_bytes

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for bucket in self.buckets for s in bucket)

    @property
    def names(self) -> list[str]:
        return [s.name for bucket in self.buckets for s in bucket]

    def to_json(self) -> str:
        return json.dumps([[asdict(s) for s in bucket] for bucket in self.buckets])

    @classmethod
    def from_json(cls, text: str) -> BucketLayout:
        return cls(tuple(tuple(TensorSlot(**{**s, "shape": tuple(s["shape"])}) for s in bucket)
                         for bucket in json.loads(text)))


def layer_key(name: str) -> str:
    """The unit a bucket keeps whole: the decoder layer ("model.layers.3") when the name has an index,
    else the module ("model.embed_tokens.weight" -> "model.embed_tokens")."""
    m = _LAYER_INDEX.match(name)
    return m.group(1) if m else name.rpartition(".")[0]


def plan_buckets(specs: Iterable[tuple[str, tuple[int, ...], str, int]], bucket_bytes: int) -> BucketLayout:
    """Buckets of at most `bucket_bytes` (a layer larger than that alone in one) from (name, shape,
    dtype, itemsize) in sending order; consecutive tensors of one `layer_key` share a bucket."""
    if bucket_bytes < 1:
        raise InputError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    units: list[list[tuple[str, tuple[int, ...], str, int]]] = []
    for spec in specs:
        if units and layer_key(units[-1][-1][0]) == layer_key(spec[0]):
            units[-1].append(spec)
        else:
            units.append([spec])
    buckets: list[list[TensorSlot]] = []
    end = 0  # bytes used in the last bucket
    for unit in units:
        sizes = [_numel(shape) * itemsize for _, shape, _, itemsize in unit]
        need = sum(_aligned(n) for n in sizes)
        if not buckets or (end and _aligned(end) + need > bucket_bytes):
            buckets.append([])
            end = 0
        for (name, shape, dtype, _), n in zip(unit, sizes, strict=True):
            offset = _aligned(end)
            buckets[-1].append(TensorSlot(name, tuple(shape), dtype, offset, n))
            end = offset + n
    return BucketLayout(tuple(tuple(b) for b in buckets))


def specs_of(weights: list[tuple[str, Any]]) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, dtype name, itemsize) of each tensor, for `plan_buckets`."""
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.element_size()) for n, t in weights]


def flatten(slots: tuple[TensorSlot, ...], tensors: list[Any], out):
    """Copy `tensors` (in `slots` order) into the uint8 buffer `out` at their offsets; returns the
    bucket's part of `out` (its first `bucket_bytes` bytes)."""
    import torch

    for slot, t in zip(slots, tensors, strict=True):  # from pinned host memory to a GPU: asynchronous
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[slot.offset:slot.offset + slot.num_bytes].copy_(src, non_blocking=src.is_pinned() and out.is_cuda)
    return out[:slots[-1].offset + slots[-1].num_bytes]


def unflatten(slots: tuple[TensorSlot, ...], flat) -> list[tuple[str, Any]]:
    """(name, view into `flat`) per slot: no copy; the views live as long as `flat` is not reused."""
    import torch

    return [(s.name, flat[s.offset:s.offset + s.num_bytes].view(getattr(torch, s.dtype)).view(s.shape))
            for s in slots]


class SyncGroup:
    """Rank `rank` of a `backend` group ("gloo" or "nccl", `BACKENDS`) of `world_size` processes
    rendezvoused at host:port (rank 0 serves the store); every wait longer than `timeout_s` raises
    `WeightSyncError`. `device`: where its buffers live (host memory for gloo, this process's current
    GPU for nccl)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"):
        import torch
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ConfigError(f"weight-sync backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("weight-sync backend 'nccl' needs CUDA and NCCL in both processes (this one has "
                              "none): WeightSyncConfig(backend='gloo') syncs through host memory")
        self.rank, self.world_size, self.timeout_s, self.backend = rank, world_size, timeout_s, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        with _failing(self, f"joining the weight-sync group at {host}:{port}"):
            self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
            self.pg = _process_group(backend, dist.PrefixStore("rlcheck-weight-sync", self.store), rank, world_size, timeout)

    def broadcast(self, tensor, what: str) -> None:
        """Rank 0's `tensor` into every rank's `tensor`, in place."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with _failing(self, what):
            self.pg.broadcast([tensor], opts).wait()


def _process_group(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The bare process group of `backend` on `store` (`broadcast([tensor], opts)` either way)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


@contextmanager
def _failing(group: SyncGroup, what: str):
    """Torch's errors of a wait past the timeout (DistError, DistStoreError, gloo's) as `WeightSyncError`."""
    try:
        yield
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight sync: {what} failed on rank {group.rank}/{group.world_size} ({str(exc).splitlines()[0]}); "
            f"a peer did not take part within {group.timeout_s:g} s (LoopConfig.collective_timeout_s): is the "
            "other side dead or stuck? LoopConfig.weight_sync='object-store' does without the collective") from exc


def send_weights(group: SyncGroup, weights: list[tuple[str, Any]], bucket_bytes: int) -> dict[str, float]:
    """Rank 0: the layout, then every bucket; the bytes sent and the seconds spent."""
    import torch

    if not weights:
        raise InputError("send_weights got no tensors (was gather_weights called on rank 0?)")
    t0 = time.perf_counter()
    layout = plan_buckets(specs_of(weights), bucket_bytes)
    _broadcast_text(group, layout.to_json())
    by_name = dict(weights)
    buf = torch.empty(max(layout.bucket_bytes(i) for i in range(len(layout.buckets))), dtype=torch.uint8, device=group.device)
    for i, slots in enumerate(layout.buckets):
        group.broadcast(flatten(slots, [by_name[s.name] for s in slots], buf), f"sending bucket {i}")
    return {"bytes": float(layout.num_bytes), "buckets": float(len(layout.buckets)), "send_s": time.perf_counter() - t0}


def receive_buckets(group: SyncGroup, stats: dict[str, float]) -> Iterator[list[tuple[str, Any]]]:
    """An engine: the layout, then each bucket as (name, view) pairs, one buffer reused (a bucket's
    views are dead once the next is asked for); `stats` gets the bytes and the seconds waited."""
    import torch

    layout = BucketLayout.from_json(_broadcast_text(group, None))
    buf = torch.empty(max(layout.bucket_bytes(i) for i in range(len(layout.buckets))), dtype=torch.uint8, device=group.device)
    stats.update(bytes=float(layout.num_bytes), buckets=float(len(layout.buckets)), receive_s=0.0)
    for i, slots in enumerate(layout.buckets):
        t = time.perf_counter()
        flat = buf[:layout.bucket_bytes(i)]
        group.broadcast(flat, f"receiving bucket {i}")
        stats["receive_s"] += time.perf_counter() - t
        yield unflatten(slots, flat)


class Buckets:
    """The buckets of one collective sync, as `VLLMEngine.sync_weights` takes them: through the same
    method as an object-store sync, so an engine fault that wraps it (stale-buffer, perturb-layer)
    acts after a collective sync too. The engine's workers receive them themselves:
    `rlcheck.engines.vllm_worker_sync` (`WorkerBuckets`, `receive_into`)."""

    def __init__(self, buckets: Iterable[list[tuple[str, Any]]]):
        self.buckets = buckets

    def __iter__(self) -> Iterator[list[tuple[str, Any]]]:
        return iter(self.buckets)


def load_buckets(engine: Any, buckets: Iterable[list[tuple[str, Any]]], version: int) -> None:
    """Load new weights into `engine` (a `VLLMEngine`) in place, one `reload_weights` per bucket (any
    subset of the weights; a bucket is taken from `buckets` only once the one before is loaded; CPU MoE
    experts prepacked again as they load, `vllm_sync.prepack_moe_on_reload`), bring the Mamba conv buffers that vLLM 0.32's CPU backend leaves on the old weights up to date
    (`vllm_sync.refresh_mamba_conv_weights`, a no-op elsewhere; docs/mamba-conv-sync.md) and drop every
    cache computed with the old weights (prefix cache); rollouts generated afterwards carry `version`."""
    from rlcheck.engines.vllm_sync import prepack_moe_on_reload, refresh_mamba_conv_weights

    if version <= engine.weight_version:
        raise InputError(f"weight version must increase: {version} after {engine.weight_version}")
    engine.llm.apply_model(prepack_moe_on_reload)  # vLLM 0.32 CPU MoE: prepack the experts on updates too
    num_tensors = 0
    if hasattr(buckets, "receive"):  # each worker receives its buckets itself (`vllm_worker_sync.WorkerBuckets`)
        num_tensors = buckets.receive(engine.llm)
    for bucket in () if hasattr(buckets, "receive") else buckets:
        if bucket:
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bucket})
            num_tensors += len(bucket)
    if not num_tensors:
        raise InputError("sync_weights got no tensors")
    refresh_mamba_conv_weights(engine.llm)
    engine.llm.reset_prefix_cache()
    engine.weight_version = version


def _broadcast_text(group: SyncGroup, text: str | None) -> str:
    """Rank 0's `text` on every rank (the others pass None): its length, then its UTF-8 bytes."""
    import torch

    data = (text or "").encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=group.device)
    group.broadcast(size, "the layout's size")
    if group.rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(group.device)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8, device=group.device)
    group.broadcast(buf, "the layout")
    return bytes(buf.cpu().numpy()).decode()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES

