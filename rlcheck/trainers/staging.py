"""The trainer's weights brought to host memory for a weight sync, one tensor at a time.

    weights = host_weights(module.state_dict(keep_vars=True).items(), full, keep=rank == 0)

`full(name, source)` makes one entry whole where it lies, on the device (FSDP2: cast the shard to the
engine's dtype, then gather it: half the bytes of gathering float32 masters and casting on the host);
every rank calls it for every entry (it may be a collective). Rank 0 (`keep`) copies each result once
into host memory, pinned when it comes from a GPU (the copies run asynchronously, one synchronization
at the end, and the collective sync's host-to-device copies run at full speed). A tied weight (the same
parameter under two names: `lm_head.weight` and `model.embed_tokens.weight`) is gathered and copied
once and handed out under both names: vLLM's reload of a tied model needs both, since the engine's
`lm_head` otherwise keeps the old weights (measured on a tied tiny Llama: 1.37 nats off after a sync
without `lm_head.weight`, 1e-6 with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Weights = list[tuple[str, torch.Tensor]]


def host_weights(entries: Iterable[tuple[str, torch.Tensor]], full: Callable[[str, torch.Tensor], torch.Tensor],
                 keep: bool) -> Weights | None:
    """(name, host tensor) for every entry on the rank that keeps them (each a fresh tensor: the
    result outlives the next call), None elsewhere. `entries`: (name, source) with a tied parameter's
    source the same object under each name (a `state_dict(keep_vars=True)`)."""
    out: Weights = []
    copied: dict[int, torch.Tensor | None] = {}  # id(source) -> its host copy
    on_gpu = False
    for name, source in entries:
        if id(source) not in copied:
            whole = full(name, source).detach()
            on_gpu |= whole.is_cuda
            copied[id(source)] = _to_host(whole) if keep else None
        if keep:
            out.append((name, copied[id(source)]))
    if on_gpu:
        torch.cuda.synchronize()  # the one wait for every asynchronous copy
    return out if keep else None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: pinned and asynchronous from a GPU, a plain copy from host memory."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return host.copy_(t, non_blocking=t.is_cuda)
