"""The per-chunk math of the chunked LM-head kernel (`rlcheck.trainers.chunked_logprobs`): the logit
transform and its gradient, one chunk's logits (kept or recomputed), its log-softmax, entropy and
top-K, its gradient, how many chunks the forward keeps, and float32 matmuls held at IEEE precision
(`exact_fp32`). torch only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """Inside, float32 matmuls run at IEEE float32 precision whatever the process asked for elsewhere:
    TF32 on CUDA (`torch.backends.cuda.matmul.allow_tf32`, `set_float32_matmul_precision("high")`,
    which many trainers turn on) or bfloat16 passes on CPUs with AMX / AVX512-BF16 (oneDNN,
    `set_float32_matmul_precision("medium")`): both carry ~1e-3 relative error (0.01+ nats at a logit
    of 10), which the float32 path must not. The settings are put back on exit. bfloat16 matmuls are
    not affected."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    old = [b.fp32_precision for b in backends]
    for b in backends:
        b.fp32_precision = "ieee"
    try:
        yield
    finally:
        for b, precision in zip(backends, old, strict=True):
            b.fp32_precision = precision


class Transform(NamedTuple):
    """z = softcap(x * scale) / temperature, applied to the float32 logits x of one chunk."""

    scale: float
    softcap: float | None
    temperature: float

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None and self.temperature == 1.0

    def grad_(self, grad_z: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """dL/dx from dL/dz (in place), z the transformed logits."""
        if self.softcap is not None:  # d tanh(u)/du = 1 - tanh(u)^2, tanh(u) = z * T / c
            grad_z.mul_(z.mul(self.temperature / self.softcap).square_().neg_().add_(1.0))
        return grad_z if self.scale == self.temperature else grad_z.mul_(self.scale / self.temperature)


def chunk_logits(h: torch.Tensor, weight, bias, tf: Transform, keep: bool = False, overwritten: bool = True):
    """(transformed float32 logits of one chunk (c, V), the raw matmul output (c, V) if `keep` else
    None): matmul in the weight dtype, like the model. A kept float32 output is copied first unless
    nothing writes into the logits (no transform, `overwritten` False: the caller only reads them)."""
    x = F.linear(h.to(weight.dtype), weight, bias)  # (c, V)
    if x.dtype != torch.float32:
        return tf.apply_(x.float()), (x if keep else None)
    copy = keep and (overwritten or not tf.is_identity)
    return tf.apply_(x.clone() if copy else x), (x if keep else None)


def kept_logits(x: torch.Tensor, tf: Transform) -> torch.Tensor:
    """`chunk_logits`' transformed logits from its kept raw output `x` (overwritten if float32)."""
    return tf.apply_(x if x.dtype == torch.float32 else x.float())


def num_kept(keep_bytes: float, itemsize: int, num_chunks: int, chunk_bytes: int = 0, keep_limit: float = math.inf) -> int:
    """How many chunks (the first ones) keep their logits for the backward within `keep_bytes` per
    logit of `itemsize` bytes and `keep_limit` bytes in all, a chunk's logits being `chunk_bytes`
    (rounded down: never above either budget)."""
    by_share = math.floor(keep_bytes / itemsize * num_chunks + 1e-9)
    by_limit = num_chunks if not chunk_bytes or math.isinf(keep_limit) else math.floor(keep_limit / chunk_bytes)
    return max(0, min(num_chunks, by_share, by_limit))


def chunk_topk(lp: torch.Tensor, ids: torch.Tensor | None, top_k: int):
    """(logp at `ids` (c, K) with -inf at padding ids (-1), own top-`top_k` ids (c, k)) of one
    chunk's log-softmax `lp` (c, V); either is None when not asked for."""
    at = None
    if ids is not None:
        pad = ids < 0
        at = lp.gather(1, ids.clamp(min=0)).masked_fill_(pad, -math.inf)  # (c, K)
    own = lp.topk(top_k, dim=1, sorted=True).indices if top_k else None  # (c, k)
    return at, own


def chunk_forward(z: torch.Tensor, t: torch.Tensor, with_entropy: bool, topk=None):
    """(logp, lse, entropy | None, top-k scores) of one chunk; overwrites z. `log_softmax` works row
    by row in cache, faster than whole-chunk passes (max, subtract, exp, sum) over a chunk that is not.
    `topk`: (ids (c, K) or None, top_k) for `chunk_topk`, or None."""
    target = z.gather(1, t[:, None]).squeeze(1)  # (c,)
    lp = z.log_softmax(dim=1)  # (c, V)
    logp = lp.gather(1, t[:, None]).squeeze(1)
    scores = (None, None) if topk is None else chunk_topk(lp, *topk)
    if not with_entropy:
        return logp, target - logp, None, scores
    p = torch.exp(lp, out=z)
    neg_ent = torch.bmm(p[:, None, :], lp[:, :, None]).view(-1)  # (c,) sum p log p, no (c, V) temporary
    return logp, target - logp, neg_ent.neg_(), scores


def chunk_grad(z, tf: Transform, t, lse, g_logp, entropy_and_grad) -> torch.Tensor:
    """dL/dx of one chunk, (c, V) float32, x the raw logits, from its transformed logits z (recomputed
    or kept; overwritten).

    dlogp_t/dz_k = [k = t] - p_k;  dH/dz_k = -p_k (log p_k + H).
    """
    dz = None if tf.softcap is None else z.clone()
    if entropy_and_grad is None:
        gz = torch.softmax(z, dim=1).mul_(-g_logp[:, None])  # row-fused, like the forward
    else:
        ent, g_ent = entropy_and_grad
        lp = z.sub_(lse[:, None])  # log p, (c, V)
        p = lp.exp()
        coef = lp.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_logp[:, None])
        gz = p.mul_(coef).neg_()
    gz.scatter_add_(1, t[:, None], g_logp[:, None].to(gz.dtype))
    return tf.grad_(gz, dz)
