"""The torch path's per-sequence statistics and signature sums, as device tensors (`torch_partial`
copies them to the host in one go): the numpy path's `sequences.sequence_stats` and
`signatures.signature_stats`, from segment reductions (`torch_kernels.flag_stats`,
`segment_max_sum`) instead of reduceat."""

from __future__ import annotations

from rlcheck.core.stats.torch_kernels import count, flag_stats, position_histogram, segment_max_sum, sum64

OFFENDER_FIELDS = ("index", "max_abs_diff", "first_divergence", "length", "mean_diff", "nonfinite")


def _first(a, b):
    """Elementwise earliest of two (N,) first positions, -1 meaning none."""
    import torch

    big = torch.iinfo(torch.int64).max
    m = torch.minimum(torch.where(a >= 0, a, big), torch.where(b >= 0, b, big))
    return torch.where(m == big, -1, m)


def sequence_parts(cfg, cu, d, ad, valid, bad, top_k: int) -> dict:
    """{"sums": {...}, "maxima": {...}, "minima": {...}, "hists": {...}, "offenders": (k, 6) float64}
    of device tensors: `sequences.sequence_stats` of (M,) d and |d| (0 where invalid), `valid` and
    `bad` (M,) bool or None, over the sequences of `cu` (N+1,)."""
    import torch

    lens = cu[1:] - cu[:-1]  # (N,)
    num = lens.shape[0]
    seq_max, seq_sum = segment_max_sum(ad, d, cu)  # (N,) float64 each
    counts = lens if valid is None else lens - flag_stats(~valid, cu, 1)[0]
    if bad is None:
        seq_bad, bad_first = torch.zeros(num, dtype=torch.bool, device=cu.device), torch.full_like(lens, -1)
    else:
        bad_count, _, bad_first = flag_stats(bad, cu, 1)
        seq_bad = bad_count > 0  # (N,) holds a non-finite token
    counted = counts > 0
    seq_mean = seq_sum / torch.clamp(counts, min=1)

    _, head_div, first_tau = flag_stats(ad > cfg.divergence_tau, cu, cfg.early_span)
    over, head_cat, _ = flag_stats(ad >= cfg.catastrophic_tau, cu, cfg.early_span)
    first_div = _first(first_tau, bad_first)  # (N,) -1 where none
    rate = (over >= cfg.catastrophic_min_tokens) & (over >= cfg.catastrophic_min_frac * counts)
    early_clause = ((first_tau >= 0) & (first_tau < cfg.early_window) & (head_cat > 0)
                    & (head_div >= cfg.catastrophic_min_tokens))
    catastrophic = rate | early_clause | seq_bad
    early_any = (first_div >= 0) & (first_div < cfg.early_window)

    c, s = count, sum64
    sums = dict(
        seq_n=c(counted), seq_empty=c(~counted), seq_max=s(torch.where(counted, seq_max, 0.0)),
        seq_logratio=s(torch.where(counted, seq_sum, 0.0)), seq_lppl=s(torch.where(counted, seq_mean, 0.0)),
        seq_flagged=c((seq_max > cfg.divergence_tau) | seq_bad), seq_cat=c(catastrophic),
        early_div=c(catastrophic & early_any), early_any=c(early_any),
        early_slots=s(torch.clamp(counts, max=cfg.early_window)),
    )
    maxima = dict(seq_logratio=torch.where(counted, seq_sum.abs(), 0.0).max(),
                  seq_lppl=torch.where(counted, seq_mean.abs(), 0.0).max())
    minima = dict(first_div=torch.where(first_div >= 0, first_div.double(), torch.inf).min())
    hists = dict(first_div=position_histogram(first_div))

    score = torch.where(seq_bad, torch.inf, seq_max)
    top = torch.sort(-score, stable=True).indices[:min(top_k, num)]  # ties to the lower index, as in merge()
    offenders = torch.stack([top.double(), seq_max[top], first_div[top].double(), lens[top].double(),
                             seq_mean[top], seq_bad[top].double()], dim=1)  # (k, 6) OFFENDER_FIELDS
    return dict(sums=sums, maxima=maxima, minima=minima, hists=hists, offenders=offenders)


def signature_sums(batch, cfg, lr, lt, cu, valid, f64: bool, tensor) -> dict:
    """`signatures.signature_stats`' shift-by-one and token-id sums (sh_*, tok_*) as device tensors
    (lr, lr2 and dlr come from the token pass); `tensor` reads a batch field onto the device."""
    import torch

    m = lr.shape[0]
    lens = cu[1:] - cu[:-1]
    w = cfg.shift_window - 1
    span = torch.clamp(torch.clamp(lens, max=cfg.shift_window) - 1, min=0)  # (N,) pairs per sequence
    k = torch.arange(max(w, 0), device=cu.device)
    j = torch.clamp(cu[:-1, None] + k[None, :], max=max(m - 2, 0)).reshape(-1)  # (N*w,) first token of a pair
    ok = (k[None, :] < span[:, None]).reshape(-1)
    if valid is not None:
        ok &= valid[j] & valid[torch.clamp(j + 1, max=m - 1)]
    j1 = torch.clamp(j + 1, max=m - 1)
    lt0, lr0, lt1, lr1 = lt[j], lr[j], lt[j1], lr[j1]
    if f64:
        lt0, lr0, lt1, lr1 = lt0.double(), lr0.double(), lt1.double(), lr1.double()

    def total_abs(a, b):
        return sum64(torch.where(ok, (a - b).abs(), 0.0))

    out = dict(sh_n=count(ok), sh_e0=total_abs(lt0, lr0), sh_ep=total_abs(lt0, lr1),
               sh_em=total_abs(lt1, lr0))
    if batch.tokens is not None and batch.tokens_train is not None:
        mask = tensor(batch.mask, "mask")
        differ = tensor(batch.tokens, "tokens") != tensor(batch.tokens_train, "tokens_train")
        out["tok_n"] = lr.new_full((), m, dtype=torch.float64) if mask is None else count(mask)
        out["tok_mismatch"] = count(differ if mask is None else differ & mask)
    else:
        out["tok_n"] = out["tok_mismatch"] = lr.new_zeros((), dtype=torch.float64)
    return out
