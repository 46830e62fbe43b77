"""compute_partial in torch, on the device the batch's tensors are on (a numpy batch is read zero-copy).

The numpy path's statistics (`rlcheck.core.stats.partial`) with its keys, branches and precision
rules: invalid tokens zeroed, float32 worked in float32 unless some |d| > F32_SAFE, sums accumulated
in float64, d capped at RATIO_LOG_CAP before any exponential. The token pass (`torch_kernels.token_pass`,
every per-token sum in one function) is what torch.compile fuses; the per-sequence parts are segment
reductions (`torch_sequences`). Two small device-to-host copies: the prepass's five scalars, which
pick the numpy path's branches, and the result, every number of the partial stacked in one float64
tensor (offenders: the top-K rows only).
"""

from __future__ import annotations

import numpy as np

from rlcheck.core.stats import torch_kernels as TK
from rlcheck.core.stats.residual import add_residual
from rlcheck.core.stats.torch_distribution import distribution_sums
from rlcheck.core.stats.torch_sequences import OFFENDER_FIELDS, sequence_parts, signature_sums
from rlcheck.core.stats.torch_turns import turn_partial_torch
from rlcheck.core.stats.turns import turn_positions
from rlcheck.core.stats.twins import add_twins
from rlcheck.core.stats.types import F32_SAFE, R_FROM_E, RATIO_LOG_CAP, PartialStats, StatsConfig
from rlcheck.core.types import Offender, rank_offenders

TOKEN_SUMS = ("d", "ad", "d2", "e", "e2", "k3", "mpe", "ratio_above", "clipped", "r", "r2", "pdiff",
              "cat_tok", "ad_clip", "lr", "lr2", "dlr")  # token_pass's first outputs, in its order


def compute_partial_torch(batch, cfg: StatsConfig, compiled: bool, versions: dict) -> PartialStats:
    """`compute_partial(batch, cfg)` of a batch with at least one token, in torch (`compiled`: the
    token pass through torch.compile); `versions` is the batch's `version_counts`."""
    import torch

    held = batch.device_tensors or {}
    device = held["logp_rollout"].device if held else torch.device("cpu")

    def tensor(x, name=None):
        """A batch field on the device: the batch's device tensor, else its numpy array (zero-copy on the CPU)."""
        if name is not None and held:
            return held[name]
        return None if x is None else torch.from_numpy(x).to(device)

    with torch.no_grad():
        lr, lt, mask, cu = (tensor(getattr(batch, k), k) for k in ("logp_rollout", "logp_train", "mask", "cu_seqlens"))
        if lr.dtype != lt.dtype:
            lr, lt = lr.double(), lt.double()
        bad, valid, pre = TK.prepass(lr, lt, mask)  # eager: compiled, it ran 3x slower here
        n_bad, n_masked, d_max, d_min, n = pre.tolist()  # device-to-host copy 1 of 2
        if not n_bad:
            bad, valid = None, (None if n_masked == 0 else mask)  # as partial._validity's None
        ad_max = max(d_max, -d_min, 0.0)
        f64 = ad_max > F32_SAFE or lr.dtype == torch.float64
        flags = dict(f64=f64, clipped=d_max > RATIO_LOG_CAP, direct_r=d_min < R_FROM_E, masked=valid is not None)
        consts = dict(thresholds=tuple(float(t) for t in cfg.thresholds), ratio_c=float(cfg.ratio_c),
                      cat_tau=float(cfg.catastrophic_tau), clip=float(cfg.clip), div_tau=float(cfg.divergence_tau))
        valid_arg = valid if valid is not None else torch.ones(1, dtype=torch.bool, device=lr.device)
        # compiled for the common batches only (with or without a mask or a d below -4): a step with a
        # capped or a float32-unsafe d runs eager rather than stall compiling a variant (15-40 s here)
        common = not (flags["clipped"] or (f64 and lr.dtype != torch.float64))
        token, d, ad, e, pdiff = TK.run(TK.token_pass, (lr, lt, valid_arg), {**consts, **flags}, compiled and common)
        hist = TK.abs_histogram(ad)
        turn_sums: dict = {}
        turn_max: dict = {}
        turn_seg = None if batch.turns is None else turn_partial_torch(batch, cfg, d, ad, e, pdiff, valid,
                                                                       turn_sums, turn_max)
        seq = sequence_parts(cfg, cu, d, ad, valid, bad, cfg.top_k)
        sig = signature_sums(batch, cfg, lr, lt, cu, valid, f64, tensor)  # its pairs skip invalid tokens
        dist = distribution_sums(batch.topk, batch.mask, lr.device) if cfg.distribution else ({}, {})
        parts = [token, hist, seq["hists"]["first_div"], seq["offenders"].reshape(-1),
                 torch.stack([*seq["sums"].values(), *sig.values(), *dist[0].values(), *seq["maxima"].values(),
                              *dist[1].values(), *seq["minima"].values()])]
        flat = torch.cat([p.reshape(-1).double() for p in parts]).cpu().numpy()  # device-to-host copy 2 of 2

    sizes = np.cumsum([p.numel() for p in parts])[:-1]
    token_v, hist_v, pos_v, off_v, rest = np.split(flat, sizes)
    ntok = len(TOKEN_SUMS)
    sums = {"n": n, "n_masked": n_masked, "n_nonfinite": n_bad}
    sums.update((k, float(v)) for k, v in zip(TOKEN_SUMS, token_v[:ntok], strict=True))
    if not flags["direct_r"]:
        sums["r"], sums["r2"] = sums["e"] + n, sums["e2"] + 2.0 * sums["e"] + n
    sig_lr = {k: sums.pop(k) for k in ("lr", "lr2", "dlr")}
    thr = token_v[ntok:ntok + len(cfg.thresholds)]
    for i, v in enumerate(thr):
        sums[f"thr{i}"] = float(v)
    div_tokens, pdiff_max = token_v[ntok + len(cfg.thresholds):]
    keys = [*seq["sums"], *sig, *dist[0]]
    named = dict(zip(keys, rest[:len(keys)].tolist(), strict=True))
    sums.update(seq_total=float(batch.num_sequences), div_tokens=float(div_tokens), **named, **sig_lr)
    mkeys = [*seq["maxima"], *dist[1]]
    maxima = {"ad": ad_max, "d": d_max, "pdiff": float(pdiff_max),
              **dict(zip(mkeys, rest[len(keys):len(keys) + len(mkeys)].tolist(), strict=True))}
    minima = {"d": d_min, "first_div": float(rest[-1])}
    add_twins(batch, cfg, sums, maxima, minima)
    add_residual(batch, cfg, sums)
    hist_ad = hist_v.astype(np.int64)
    hist_ad[0] -= lr.shape[0] - int(n)
    hists = {"ad": hist_ad, "first_div": pos_v.astype(np.int64)}
    sums.update(turn_sums)
    maxima.update(turn_max)
    found = offenders(batch, off_v)
    found = found if turn_seg is None else turn_positions(found, batch, turn_seg)
    return PartialStats(sums, maxima, minima, hists, found, batch.num_sequences,
                        tuple(cfg.thresholds), cfg.top_k, versions=versions)


def offenders(batch, rows: np.ndarray) -> tuple[Offender, ...]:
    """The Offenders of the (k * 6,) OFFENDER_FIELDS rows the device ranked."""
    out = []
    for index, max_abs, first, length, mean, bad in rows.reshape(-1, len(OFFENDER_FIELDS)).tolist():
        i = int(index)
        out.append(Offender(request_id=batch.request_ids[i], index=i, max_abs_diff=max_abs,
                            first_divergence=int(first) if first >= 0 else None, length=int(length),
                            mean_diff=mean, nonfinite=bool(bad)))
    return rank_offenders(out, len(out))
