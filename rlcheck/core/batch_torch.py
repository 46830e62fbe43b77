"""`StepBatch.from_padded` / `from_packed` on torch tensors held on a device (a GPU): packed there.

The [B, T] tensors are packed on their device (the kept span of every row, as
`batch_build.packed_from_padded` keeps it), so only the packed (M,) tokens cross to the host, for
the batch's numpy fields, which every other consumer (dumps, quarantine, correction, replay) reads;
the packed device tensors ride along in `StepBatch.device_tensors`, where the statistics read them
(`rlcheck.core.stats.torch_partial`: no second copy). Inputs this path does not take (non-float
logprobs, a float mask, odd shapes) go the numpy way, so their InputError is the numpy path's, word
for word. torch is imported by the caller that made the tensors; nothing here imports it at import time.
"""

from __future__ import annotations

from typing import Any

DEVICE_FIELDS = ("logp_rollout", "logp_train", "mask", "cu_seqlens", "tokens", "tokens_train")


def on_device(x: Any) -> bool:
    """A torch tensor on a device other than the CPU (a CPU tensor is read zero-copy as numpy)."""
    return hasattr(x, "detach") and getattr(x, "device", None) is not None and x.device.type != "cpu"


def device_padded(lr: Any, lt: Any, mask: Any, tokens: Any, tokens_train: Any) -> dict[str, Any] | None:
    """{field: packed (M,) tensor on the device, cu_seqlens (B+1,) int64} of [B, T] device tensors, or
    None where the numpy path must read them (it raises the InputError for what is wrong). Host inputs
    return None before torch is imported (numpy-only installs build batches here too)."""
    if not (on_device(lr) and on_device(lt) and on_device(mask)):
        return None
    import torch

    def ok_int(x):
        return x is None or (on_device(x) and x.shape == lr.shape and not x.dtype.is_floating_point
                             and x.dtype != torch.bool)

    if not (lr.ndim == 2 and lr.shape[0] > 0
            and lt.shape == lr.shape and mask.shape == lr.shape and lr.dtype.is_floating_point
            and lt.dtype.is_floating_point and ok_int(tokens) and ok_int(tokens_train)):
        return None
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.dtype.is_complex or bool(((mask < 0) | (mask > 1)).any()):
            return None
        mask = mask.bool()
    b, t = lr.shape
    m8 = mask.to(torch.uint8)
    any_in = mask.any(dim=1)  # (B,)
    first = torch.where(any_in, m8.argmax(dim=1), 0)  # argmax: the first maximum
    last = torch.where(any_in, t - 1 - m8.flip(1).argmax(dim=1), -1)
    cols = torch.arange(t, device=lr.device)
    keep = (cols >= first[:, None]) & (cols <= last[:, None])  # (B, T)
    cu = torch.zeros(b + 1, dtype=torch.int64, device=lr.device)
    torch.cumsum(keep.sum(dim=1), 0, out=cu[1:])

    def widen(x):
        return x.float() if x.dtype.itemsize < 4 else x  # bf16/fp16 as float32, as batch_build.float_array

    out = {"logp_rollout": widen(lr.detach()[keep]), "logp_train": widen(lt.detach()[keep]), "mask": mask[keep],
           "cu_seqlens": cu, "tokens": None, "tokens_train": None}
    for name, x in (("tokens", tokens), ("tokens_train", tokens_train)):
        if x is not None:
            out[name] = x[keep].long()
    return out


def host_copies(tensors: dict[str, Any]) -> dict[str, Any]:
    """The numpy fields of the packed device tensors (one copy each of the (M,) tokens)."""
    return {k: None if v is None else v.cpu().numpy() for k, v in tensors.items()}


def device_packed(lr: Any, lt: Any, cu: Any, mask: Any, tokens: Any, tokens_train: Any) -> dict[str, Any] | None:
    """The device tensors of `from_packed`'s already packed inputs (for the statistics), or None
    unless both logprobs are float tensors on a device."""
    if not (on_device(lr) and on_device(lt) and lr.dtype.is_floating_point and lt.dtype.is_floating_point):
        return None
    import torch

    def dev(x, kind):
        if x is None:
            return None
        x = x if hasattr(x, "detach") else torch.as_tensor(x)
        x = x.detach().to(lr.device)
        return x.bool() if kind == "b" else x.long() if kind == "i" else (x.float() if x.dtype.itemsize < 4 else x)

    return {"logp_rollout": dev(lr, "f").reshape(-1), "logp_train": dev(lt, "f").reshape(-1),
            "mask": dev(mask, "b"), "cu_seqlens": dev(cu, "i"), "tokens": dev(tokens, "i"),
            "tokens_train": dev(tokens_train, "i")}
