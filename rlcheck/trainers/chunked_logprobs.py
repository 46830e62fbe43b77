"""The chunked LM-head kernel: token logprobs (and entropies) from final hidden states and the LM head
weight, `chunk_size` rows of logits at a time, forward and backward.

`chunked_token_logprobs(hidden, weight, targets)` equals the naive float32 log-softmax + gather (its
docstring states the formula) but never holds the [tokens, vocab] logits: a `torch.autograd.Function`
loops over chunks of rows, and its backward recomputes each chunk's logits instead of keeping them.
The model's logit transform (scale, Gemma-style softcap, temperature) is applied per chunk. torch is
the only dependency; running it inside a model's forward is `rlcheck.trainers.logprobs.token_logprobs`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlcheck.errors import ConfigError, InputError

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Default budget for one chunk's float32 logits; `chunk_size = budget // (4 * vocab)` rows."""
MIN_CHUNK_ROWS = 16


class TokenLogprobs(NamedTuple):
    logp: torch.Tensor
    """float32 log-probability of each target token."""
    entropy: torch.Tensor | None
    """float32 entropy (nats) of each position's distribution; None unless asked for."""


def default_chunk_size(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's float32 logits fit in `budget_bytes` (at least 16)."""
    return max(MIN_CHUNK_ROWS, budget_bytes // (4 * vocab_size))


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not a finite number > 0 (ConfigError)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be a finite number > 0, got {temperature!r}")


class _Transform(NamedTuple):
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

    def grad_(self, grad_z: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """dL/dx from dL/dz (in place), z the transformed logits."""
        if self.softcap is not None:  # d tanh(u)/du = 1 - tanh(u)^2, tanh(u) = z * T / c
            grad_z.mul_(z.mul(self.temperature / self.softcap).square_().neg_().add_(1.0))
        return grad_z.mul_(self.scale / self.temperature)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias, tf: _Transform) -> torch.Tensor:
    """Transformed float32 logits of one chunk, (c, V): matmul in the weight dtype, like the model."""
    x = F.linear(h.to(weight.dtype), weight, bias)  # (c, V)
    return tf.apply_(x if x.dtype == torch.float32 else x.float())


def _chunk_forward(z: torch.Tensor, t: torch.Tensor, with_entropy: bool):
    """(logp, lse, entropy | None) of one chunk; overwrites z. `log_softmax` works row by row in
    cache, faster than whole-chunk passes (max, subtract, exp, sum) over a chunk that is not."""
    target = z.gather(1, t[:, None]).squeeze(1)  # (c,)
    lp = z.log_softmax(dim=1)  # (c, V)
    logp = lp.gather(1, t[:, None]).squeeze(1)
    if not with_entropy:
        return logp, target - logp, None
    p = torch.exp(lp, out=z)
    neg_ent = torch.bmm(p[:, None, :], lp[:, :, None]).view(-1)  # (c,) sum p log p, no (c, V) temporary
    return logp, target - logp, neg_ent.neg_()


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tf, chunk_size, with_entropy):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for a in range(0, n, chunk_size):
            z = _chunk_logits(hidden[a : a + chunk_size], weight, bias, tf)
            lp, ls, en = _chunk_forward(z, targets[a : a + chunk_size], with_entropy)
            logp[a : a + chunk_size], lse[a : a + chunk_size] = lp, ls
            if with_entropy:
                ent[a : a + chunk_size] = en
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.tf, ctx.chunk_size = tf, chunk_size
        return (logp, ent) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for a in range(0, hidden.shape[0], ctx.chunk_size):
            s = slice(a, a + ctx.chunk_size)
            h = hidden[s].to(weight.dtype)
            gz = _chunk_grad(
                h,
                weight,
                bias,
                ctx.tf,
                targets[s],
                lse[s],
                grad_logp[s],
                None if grad_ent is None else (ent[s], grad_ent[s]),
            )
            gx = gz.to(weight.dtype)  # (c, V)
            if need_h:
                grad_h[s] = gx @ weight
            if need_w and gx.dtype == torch.float32:
                grad_w.addmm_(gx.T, h)
            elif need_w:  # matmul in the weight dtype, as the naive backward; summed over chunks in float32
                grad_w.add_(gx.T @ h)
            if need_b:
                grad_b.add_(gz.sum(dim=0))
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _chunk_grad(h, weight, bias, tf: _Transform, t, lse, g_logp, entropy_and_grad) -> torch.Tensor:
    """dL/dx of one chunk, (c, V) float32, x the raw logits: recomputed, never stored.

    dlogp_t/dz_k = [k = t] - p_k;  dH/dz_k = -p_k (log p_k + H).
    """
    z = _chunk_logits(h, weight, bias, tf)
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


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> TokenLogprobs:
    """Log-probabilities of `targets` under the logits `hidden @ weight.T (+ bias)`, chunked over tokens.

    Equivalent to the naive

    ```python
    x = (hidden @ weight.T + bias).float() * logit_scale                 # (N, V)
    if logit_softcap: x = logit_softcap * torch.tanh(x / logit_softcap)
    logps = (x / temperature).log_softmax(-1)                            # (N, V) float32
    logp = logps.gather(-1, targets[:, None]).squeeze(-1)                # (N,)
    entropy = -(logps.exp() * logps).sum(-1)                             # (N,)
    ```

    but only `chunk_size` rows of logits exist at a time, in the forward and in the backward (which
    recomputes them). The matmul runs in `weight`'s dtype (as the model's LM head does), everything
    after it in float32. Differentiable in `hidden`, `weight` and `bias`.

    Args:
        hidden: (N, H) final hidden states (after the final norm): one row per scored token.
        weight: (V, H) LM head weight. bias: (V,) or None.
        targets: (N,) int64 token ids; row i is scored on `targets[i]` (no shift here).
        temperature: sampling temperature (> 0, finite); the logits are divided by it.
        logit_scale: multiplies the logits first (Cohere `logit_scale`; Granite: 1 / `logits_scaling`).
        logit_softcap: Gemma-style `final_logit_softcapping`, applied after the scale; None for none.
        chunk_size: rows per chunk; default `default_chunk_size(V)` (64 MiB of float32 logits).
        with_entropy: also return each row's entropy.

    Returns:
        `TokenLogprobs(logp, entropy)`: float32 (N,) tensors; entropy is None unless asked for.
    """
    check_temperature(temperature)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise InputError(
            f"need hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise InputError(f"targets must be (N,) = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if type(weight).__name__ == "DTensor":
        raise InputError(
            "weight is a sharded DTensor: pass the FSDP-wrapped model to token_logprobs, "
            "which runs this inside the model's forward where the weight is unsharded"
        )
    tf = _Transform(float(logit_scale), logit_softcap, float(temperature))
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    out = _ChunkedLogprobs.apply(hidden, weight, bias, targets.long(), tf, chunk, with_entropy)
    return TokenLogprobs(*out) if with_entropy else TokenLogprobs(out, None)
