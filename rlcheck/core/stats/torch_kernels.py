"""The torch path's token pass (what torch.compile fuses), its |d| and position histograms, and the
segment reductions the per-sequence statistics are built of. torch is imported inside each function:
this module is imported only once a batch goes the torch way (`rlcheck.core.stats.backend`)."""

from __future__ import annotations

import logging
import threading

from rlcheck.core import histogram as H
from rlcheck.core.stats.types import MIN_LOGPROB, RATIO_LOG_CAP

log = logging.getLogger(__name__)
_BLOCK = 4096  # as in sums.py
_R_FLOOR = -300.0  # as in partial.py: d below this counts as this in sum r, sum r^2
_compiled = {}  # function name -> its torch.compile, made once per process; "failed" -> True after a failure
_lock = threading.Lock()


def sum64(x):
    """0-d float64 sum of a float tensor: float32 block sums (torch's cascade summation inside each
    block) added in float64, as `rlcheck.core.stats.sums.sum64`, without a float64 copy."""
    import torch

    if x.dtype == torch.float64 or x.shape[0] < 2 * _BLOCK:
        return x.sum(dtype=torch.float64)
    n = x.shape[0] // _BLOCK * _BLOCK
    return x[:n].view(-1, _BLOCK).sum(dim=1).sum(dtype=torch.float64) + x[n:].sum(dtype=torch.float64)


def count(flags):
    """0-d float64 number of True in a bool tensor."""
    import torch

    return torch.count_nonzero(flags).double()


def host_path(device) -> bool:
    """Whether the per-sequence reductions read flagged tokens by `nonzero` and reduce on the host
    (a CPU tensor: no sync to avoid) rather than by int cumsums and torch.segment_reduce (a device)."""
    return device.type == "cpu"


def prepass(lr, lt, mask):
    """(bad, valid, (5,) float64 [non-finite count, masked-out count, max d, min d, valid count]) of the
    (M,) logprobs: the scalars that pick the numpy path's branches. bad: (M,) bool unmasked tokens that
    are NaN, -inf or below MIN_LOGPROB on either side; valid: (M,) bool tokens that count."""
    import torch

    bad = ~((lr >= MIN_LOGPROB) & (lt >= MIN_LOGPROB))  # (M,) NaN compares False
    if mask is not None:
        bad &= mask
    valid = ~bad if mask is None else mask & ~bad
    d = lt - lr
    n_valid = count(valid)
    n_masked = n_valid * 0.0 if mask is None else lr.shape[0] - count(mask)
    return bad, valid, torch.stack([
        count(bad), n_masked,
        torch.where(valid, d, -torch.inf).max().double(), torch.where(valid, d, torch.inf).min().double(), n_valid,
    ])


def expm1(x):
    """expm1 rounded to x's dtype from float64: torch's float32 expm1 on the CPU is a few ulp off with
    a bias, which sum(e) (chi2 = (sum e^2 + 2 sum e) / n) turns into a 4e-5 relative error at |d| ~ 1e-3."""
    import torch

    return torch.expm1(x) if x.dtype == torch.float64 else torch.expm1(x.double()).to(x.dtype)


def token_pass(lr, lt, valid, thresholds: tuple, ratio_c: float, cat_tau: float, clip: float, div_tau: float,
               f64: bool, clipped: bool, direct_r: bool, masked: bool):
    """((S,) float64 token sums in torch_partial.TOKEN_SUMS order, then one per threshold, then
    [div_tokens, pdiff max], d (M,), |d| (M,), r - 1 (M,), |p_t - p_r| (M,)) of (M,) logprobs, the numpy path's formulas and
    precision: invalid tokens zeroed (`masked`), float32 worked in float32 unless `f64`, float64 sums,
    d capped at RATIO_LOG_CAP before any exponential (a no-op unless `clipped`). sum r and sum r^2 are
    NaN unless `direct_r` (then they come from the sums of e, as in partial._ratio_sums)."""
    import torch

    if masked:
        lr, lt = torch.where(valid, lr, 0.0), torch.where(valid, lt, 0.0)
    d = lt - lr  # (M,)
    sum_d = d.sum(dtype=torch.float64)  # signed: cancels, so float64 all the way (as partial.py)
    if f64:
        d, lr, lt = d.double(), lr.double(), lt.double()
    ad = d.abs()

    s, c = sum64, count
    e = expm1(torch.clamp(d, max=RATIO_LOG_CAP))  # r - 1
    if direct_r:
        r = torch.exp(torch.clamp(d, _R_FLOOR, RATIO_LOG_CAP))
        if masked:
            r = torch.where(valid, r, 0.0)
        sum_r, sum_r2 = s(r), s(r * r)
    else:
        sum_r = sum_r2 = torch.full((), torch.nan, dtype=torch.float64, device=d.device)
    if clipped:
        pdiff = torch.exp(torch.maximum(lt, lr)) * -torch.expm1(-ad)
    else:
        pdiff = e.abs() * torch.exp(lr)
    out = [sum_d, s(ad), s(d * d), s(e), s(e * e), s(e - d), s(expm1(torch.clamp(ad, max=RATIO_LOG_CAP))),
           c(e > ratio_c - 1.0), c(d > RATIO_LOG_CAP), sum_r, sum_r2, s(pdiff), c(ad >= cat_tau),
           s(torch.clamp(ad, max=clip)), s(lr), s(lr * lr), s(d * lr)]
    out += [c(ad > t) for t in thresholds]
    out += [c(ad > div_tau), pdiff.max().double()]
    return torch.stack(out), d, ad, e, pdiff


def run(fn, args, kwargs, compiled: bool):
    """fn(*args, **kwargs) (`token_pass`), through torch.compile when `compiled`: compiled
    once per process and function, reused for every later batch (dynamic shapes; each branch flag
    combination is compiled on first use); a failure is logged once and eager torch runs from then on."""
    if compiled and not _compiled.get("failed"):
        with _lock:
            if fn.__name__ not in _compiled:
                import torch

                _compiled[fn.__name__] = torch.compile(fn, dynamic=True)
        try:
            return _compiled[fn.__name__](*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - no compiler, an inductor bug: the eager pass is the same math
            _compiled["failed"] = True
            log.warning("rlcheck stats: torch.compile failed (%s: %s); eager torch from now on",
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
    return fn(*args, **kwargs)


def count_codes(code, nbins: int):
    """(nbins,) int64 occurrences of each value of the int tensor `code` (all in [0, nbins)):
    torch.bincount on the CPU; a scatter-add on a device, where bincount reads the max back to size
    its output (a host sync)."""
    import torch

    if host_path(code.device):
        return torch.bincount(code, minlength=nbins)
    out = torch.zeros(nbins, dtype=torch.int64, device=code.device)
    return out.scatter_add_(0, code.long(), torch.ones_like(code, dtype=torch.int64))


def abs_histogram(ad):
    """(NUM_ABS_BINS,) int64 `rlcheck.core.histogram.abs_histogram` of (M,) non-negative values."""
    import torch

    code = ad.float().view(torch.int32) >> H._SHIFT  # (M,) < 2**13: the sign bit is 0
    counts = count_codes(code, 1 << (32 - H._SHIFT))
    return torch.cat([counts[:H._LO_CODE].sum().reshape(1), counts[H._LO_CODE:H._HI_CODE],
                      counts[H._HI_CODE:].sum().reshape(1)])


def position_histogram(pos):
    """(NUM_POS_BINS,) int64 `rlcheck.core.histogram.position_histogram` of the (N,) int64 positions
    that are >= 0 (a -1 is not counted)."""
    import torch

    code = (pos.double().view(torch.int64) >> (52 - H._SUB_BITS)) - ((1023 - 127) << H._SUB_BITS)
    big = torch.clamp(code, H._POS_LO_CODE, H._POS_HI_CODE) - H._POS_LO_CODE + H._POS_EXACT
    idx = torch.where(pos < H._POS_EXACT, pos, big)
    idx = torch.where(pos >= 0, idx, H.NUM_POS_BINS)  # an extra bin for "none", dropped
    return count_codes(idx, H.NUM_POS_BINS + 1)[:H.NUM_POS_BINS]


def flag_stats(flags, cu, span: int):
    """Per sequence of `cu` (N+1,): (count, count within the first `span` tokens, first position or -1),
    each (N,) int64, of the (M,) bool `flags`. On the CPU from the flagged tokens (few: nonzero); on a
    device from an int cumsum (exact, no host sync)."""
    import torch

    n = cu.shape[0] - 1
    starts, ends = cu[:-1], cu[1:]
    if host_path(flags.device):
        pos = flags.nonzero().squeeze(1)  # (F,) ascending
        seq = torch.searchsorted(cu, pos, right=True) - 1
        off = pos - cu[seq]
        count = torch.bincount(seq, minlength=n)
        head = torch.bincount(seq[off < span], minlength=n)
        first = torch.full((n,), -1, dtype=torch.int64).scatter_reduce_(0, seq, off, "amin", include_self=False)
        return count, head, first
    cs = torch.zeros(flags.shape[0] + 1, dtype=torch.int64, device=flags.device)
    torch.cumsum(flags, 0, out=cs[1:])  # cs[i]: flags before token i
    count = cs[ends] - cs[starts]
    head = cs[torch.minimum(starts + span, ends)] - cs[starts]
    first = torch.searchsorted(cs, cs[starts] + 1) - 1 - starts
    return count, head, torch.where(count > 0, first, -1)


def segment_max_sum(ad, d, cu):
    """((N,) float64 max of `ad` (M,), 0 for empty sequences; (N,) float64 sum of `d` (M,)) over each
    sequence of `cu` (N+1,): numpy's reduceat on a CPU tensor (zero-copy), torch.segment_reduce elsewhere."""
    import numpy as np
    import torch

    lens = cu[1:] - cu[:-1]
    if host_path(ad.device):
        from rlcheck.core.stats.sequences import segment_max

        cu_np, nonempty = cu.numpy(), (lens > 0).numpy()
        seq_sum = np.zeros(lens.shape[0], dtype=np.float64)
        seq_sum[nonempty] = np.add.reduceat(d.numpy(), cu_np[:-1][nonempty], dtype=np.float64)
        return torch.from_numpy(segment_max(ad.numpy(), cu_np)), torch.from_numpy(seq_sum)
    seq_max = torch.segment_reduce(ad, "max", lengths=lens, unsafe=True, initial=0.0).double()
    seq_sum = torch.segment_reduce(d.double(), "sum", lengths=lens, unsafe=True)
    return seq_max, torch.where(lens > 0, seq_sum, 0.0)
