"""The per-turn statistics (`rlcheck.core.stats.turns`) in torch, from the token pass's tensors, on the device
the batch's tensors are on: the same segments (laid out on the host from `StepBatch.turns`), their sums and
maxima by `torch.segment_reduce` (on a CPU tensor: numpy's reduceat, zero-copy, as `torch_kernels` does),
one device-to-host copy of the (S, Q) result; the slots and metrics are the numpy path's."""

from __future__ import annotations

from rlcheck.core.stats import torch_kernels as TK
from rlcheck.core.stats.turns import Segments, segment_sums, segments, slot_parts


def turn_partial_torch(batch, cfg, d, ad, e, pdiff, valid, sums: dict, maxima: dict) -> Segments:
    """Add the "turn/..." sums and maxima of `batch` to `sums` and `maxima` from the token pass's (M,)
    tensors (`d`, `ad`, `e` = r - 1, `pdiff`, invalid tokens zeroed; `valid` None when every token counts);
    its segments."""
    import torch

    seg = segments(batch.turns, batch.cu_seqlens, cfg.turn_head_tokens)
    values = {"n": None if valid is None else valid, "ad": ad, "ad_clip": torch.clamp(ad, max=cfg.clip), "d": d,
              "e": e, "pdiff": pdiff, "cat": ad >= cfg.catastrophic_tau}
    num_tokens = batch.num_tokens
    if TK.host_path(d.device):
        seg_sums, seg_max = segment_sums({k: None if v is None else v.numpy() for k, v in values.items()}, ad.numpy(),
                                         seg, num_tokens)
    else:
        seg_sums, seg_max = _device_sums(values, ad, seg, num_tokens)
    runs = batch.turns.runs(batch.cu_seqlens)
    found, top = slot_parts(seg, seg_sums, seg_max, batch.turns.turn_counts(batch.cu_seqlens),
                            num_tokens - int(runs.length.sum()))
    sums.update(found)
    maxima.update(top)
    return seg


def _device_sums(values: dict, ad, seg: Segments, num_tokens: int):
    """((S, Q) float64 sums, (S,) float64 maxima) per segment on the device: one segment_reduce each, one copy."""
    import numpy as np
    import torch

    from rlcheck.core.stats.turns import QUANTITIES

    lengths = torch.from_numpy(np.diff(np.append(seg.starts, num_tokens))).to(ad.device)  # (S,)
    ones = torch.ones_like(ad, dtype=torch.float64)
    stacked = torch.stack([ones if values[q] is None else values[q].double() for q in QUANTITIES], dim=1)  # (M, Q)
    seg_sums = torch.segment_reduce(stacked, "sum", lengths=lengths, axis=0, unsafe=True)  # (S, Q)
    seg_max = torch.segment_reduce(ad.double(), "max", lengths=lengths, unsafe=True)  # (S,)
    flat = torch.cat([seg_sums.reshape(-1), seg_max]).cpu().numpy()  # one device-to-host copy
    q = stacked.shape[1]
    return flat[:-seg_max.shape[0]].reshape(-1, q), flat[-seg_max.shape[0]:]
