"""Sums behind the signature detectors: slope of d on logp_rollout, shift-by-one fit, token ids."""

from __future__ import annotations

import numpy as np

from rlcheck.core.batch import segment_token_indices
from rlcheck.core.stats.sums import sum64, sum_product


def signature_stats(batch, cfg, lr, lt, d, valid, sums, scratch) -> None:
    """Sums behind the signature detectors: slope of d on logp_rollout, shift-by-one fit, token ids."""
    sums["lr"] = sum64(lr)
    sums["lr2"] = sum_product(lr, lr, scratch)
    sums["dlr"] = sum_product(d, lr, scratch)

    # Pairs (j, j+1) inside the first shift_window tokens of each sequence.
    cu = batch.cu_seqlens
    span = np.minimum(np.diff(cu), cfg.shift_window) - 1  # pairs per sequence
    span = np.maximum(span, 0)
    total = int(span.sum())
    if total:
        j = segment_token_indices(cu[:-1], span)  # (P,) first token of every pair
        lt0, lr0, lt1, lr1 = lt[j], lr[j], lt[j + 1], lr[j + 1]  # (P,) each
        ok = None if valid is None else valid[j] & valid[j + 1]

        def total_abs(a: np.ndarray, b: np.ndarray) -> float:
            diff = np.abs(a - b)
            return float(np.add.reduce(diff if ok is None else diff[ok], dtype=np.float64))

        sums["sh_n"] = float(total if ok is None else np.count_nonzero(ok))
        sums["sh_e0"] = total_abs(lt0, lr0)
        sums["sh_ep"] = total_abs(lt0, lr1)  # train[t] vs rollout[t+1]
        sums["sh_em"] = total_abs(lt1, lr0)  # train[t+1] vs rollout[t]
    else:
        sums.update(sh_n=0.0, sh_e0=0.0, sh_ep=0.0, sh_em=0.0)

    if batch.tokens is not None and batch.tokens_train is not None:
        compared = batch.mask if batch.mask is not None else np.ones(batch.num_tokens, dtype=bool)
        sums["tok_n"] = float(np.count_nonzero(compared))
        sums["tok_mismatch"] = float(np.count_nonzero((batch.tokens != batch.tokens_train) & compared))
    else:
        sums["tok_n"] = 0.0
        sums["tok_mismatch"] = 0.0
