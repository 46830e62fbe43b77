"""The per-turn statistics (`rlcheck.core.stats.turns`) in torch, on the device the batch's tensors are on:
the same segments (laid out on the host from `StepBatch.turns`, one (M,) int64 copy to the device), their
sums by one `index_add_` and their maxima by one `scatter_reduce_`, one device-to-host copy of the (S, Q)
result; the slots and metrics are the numpy path's."""

from __future__ import annotations

from rlcheck.core.stats.turns import Segments, segments, slot_parts
from rlcheck.core.stats.types import RATIO_LOG_CAP


def turn_partial_torch(batch, cfg, lr, lt, d, ad, valid, clipped: bool, sums: dict, maxima: dict) -> Segments:
    """Add the "turn/..." sums and maxima of `batch` to `sums` and `maxima` from the torch path's (M,)
    tensors (`d`, `ad` with invalid tokens zeroed; `valid` None when every token counts); its segments."""
    import torch

    seg = segments(batch.turns, batch.cu_seqlens, cfg.turn_head_tokens)
    device = d.device
    token_seg = torch.from_numpy(seg.token_segment(batch.num_tokens)).to(device)  # (M,)
    ok = torch.ones_like(d, dtype=torch.bool) if valid is None else valid
    lr, lt = torch.where(ok, lr, 0.0).to(d.dtype), torch.where(ok, lt, 0.0).to(d.dtype)
    e = torch.expm1(torch.clamp(d, max=RATIO_LOG_CAP))
    pdiff = torch.exp(torch.maximum(lt, lr)) * -torch.expm1(-ad) if clipped else e.abs() * torch.exp(lr)
    values = torch.stack([ok.double(), ad.double(), torch.clamp(ad, max=cfg.clip).double(), d.double(), e.double(),
                          pdiff.double(), (ad >= cfg.catastrophic_tau).double()], dim=1)  # (M, Q)
    num = seg.starts.shape[0]
    seg_sums = torch.zeros((num, values.shape[1]), dtype=torch.float64, device=device).index_add_(0, token_seg, values)
    seg_max = torch.zeros(num, dtype=torch.float64, device=device).scatter_reduce_(
        0, token_seg, ad.double(), "amax", include_self=False)
    flat = torch.cat([seg_sums.reshape(-1), seg_max]).cpu().numpy()  # one device-to-host copy
    q = values.shape[1]
    runs = batch.turns.runs(batch.cu_seqlens)
    found, top = slot_parts(seg, flat[:num * q].reshape(num, q), flat[num * q:],
                            batch.turns.turn_counts(batch.cu_seqlens), batch.num_tokens - int(runs.length.sum()))
    sums.update(found)
    maxima.update(top)
    return seg
