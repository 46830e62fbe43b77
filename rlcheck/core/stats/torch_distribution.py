"""The torch path's distribution sums (`StatsConfig.distribution`): `distribution.position_stats` on the
batch's device, over the TopK's rows in chunks, as device tensors (no host copy until the partial's)."""

from __future__ import annotations

from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.stats.distribution import _CHUNK, _MAXIMA, _SUMS
from rlcheck.core.topk import PAD_ID


def position_stats_torch(ie, le, lt, it):
    """(kl, overlap, top1, tail_e, tail_t), each (C,), of (C, K) TopK fields: `distribution.position_stats`."""
    import torch

    k = ie.shape[1]
    le, lt = le.double(), lt.double()  # (C, K)
    ve = ie != PAD_ID  # (C, K) entries of E
    res = k * float(torch.finfo(torch.float32).eps)
    pe = torch.where(ve, torch.exp(le), 0.0)  # (C, K)
    pt = torch.where(ve, torch.exp(lt), 0.0)
    tail_e = torch.clamp(1.0 - pe.sum(dim=1), min=0.0)  # (C,)
    tail_t = torch.clamp(1.0 - pt.sum(dim=1), min=0.0)
    terms = torch.where(pe > 0, pe * (le - torch.clamp(lt, min=MIN_LOGPROB)), 0.0)  # (C, K)
    tail = torch.where(tail_e > 0, tail_e * (torch.log(torch.clamp(tail_e, min=res))
                                             - torch.log(torch.clamp(tail_t, min=res))), 0.0)
    kl = terms.sum(dim=1) + tail  # (C,)
    possible = ve & torch.isfinite(le)  # (C, K) E+
    both = torch.sort(torch.cat([torch.where(possible, ie, PAD_ID), it], dim=1), dim=1).values  # (C, 2K)
    shared = ((both[:, 1:] == both[:, :-1]) & (both[:, 1:] != PAD_ID)).sum(dim=1)  # (C,) |E+ ∩ R|
    overlap = shared / torch.clamp(possible.sum(dim=1), min=1)
    top_e = ie.gather(1, torch.argmax(torch.where(ve, le, -torch.inf), dim=1, keepdim=True)).squeeze(1)
    top1 = (top_e == it[:, 0]) & (top_e != PAD_ID)
    return kl, overlap, top1, tail_e, tail_t


def distribution_sums(topk, mask, device) -> tuple[dict, dict]:
    """(sums, maxima) of `distribution.distribution_stats` as device tensors: zeros (and -inf) without
    `topk`; rows count where the mask keeps them and the engine listed an entry."""
    import torch

    def t(x):
        return (x if isinstance(x, torch.Tensor) else torch.from_numpy(x)).to(device)

    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = {key: zero for key in _SUMS}
    maxima = {key: torch.full((), -torch.inf, dtype=torch.float64, device=device) for key in _MAXIMA}
    if topk is None or topk.num_tokens == 0:
        return sums, maxima
    ie, le, lt, it = t(topk.ids_rollout), t(topk.logp_rollout), t(topk.logp_train), t(topk.ids_train)
    keep = (ie != PAD_ID).any(dim=1)  # (M,)
    if mask is not None:
        keep &= t(mask)
    step = max(1, _CHUNK // topk.k)
    for lo in range(0, ie.shape[0], step):
        rows = slice(lo, lo + step)
        kept = keep[rows]
        kl, overlap, top1, tail_e, tail_t = position_stats_torch(ie[rows], le[rows], lt[rows], it[rows])
        for key, x in (("dist_n", kept), ("dist_kl", kl), ("dist_overlap", overlap), ("dist_top1", top1),
                       ("dist_tail_e", tail_e), ("dist_tail_t", tail_t)):
            sums[key] = sums[key] + torch.where(kept, x.double(), 0.0).sum()  # (C,) rows: float64 already
        maxima["dist_kl"] = torch.maximum(maxima["dist_kl"], torch.where(kept, kl, -torch.inf).max())
    return sums, maxima
