"""The chunked LM-head kernel: token logprobs (and entropies) from final hidden states and the LM head
weight, `chunk_size` rows of logits at a time, forward and backward.

`chunked_token_logprobs(hidden, weight, targets)` equals the naive float32 log-softmax + gather (its
docstring states the formula) but never holds the float32 [tokens, vocab] logits: a
`torch.autograd.Function` loops over chunks of rows; the backward recomputes the logits of the chunks
that the forward did not keep (`keep_bytes` per logit, by default all bf16 chunks and half of float32
ones, and at most `keep_limit` bytes in all, 1 GiB by default).
The model's logit transform (scale, Gemma-style softcap, temperature) is applied per chunk. The same
pass can also give, without gradient, each row's logprobs at given ids (the engine's top-K) and its
own top-K ids (`top_k`, `topk_ids`: `TokenLogprobs.topk`), so that no [tokens, vocab] tensor is kept
for the top-k distribution metrics either. torch is the only dependency; running it inside a model's
forward is `rlcheck.trainers.logprobs.token_logprobs`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rlcheck.errors import ConfigError, InputError
from rlcheck.trainers.chunk_math import (
    Transform,
    chunk_forward,
    chunk_grad,
    chunk_logits,
    exact_fp32,
    kept_logits,
    num_kept,
)

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""Default budget for one chunk's float32 logits; `chunk_size = budget // (4 * vocab)` rows: 441 at a
151,936 vocabulary, 2,048 at 32,768. Each chunk's backward also writes a whole (V, H) weight-gradient
product, so small chunks pay it many times: at Qwen2.5-7B's head (151,936 x 3,584, bfloat16) forward +
backward took 53 CPU s per 2,048 tokens at 110 rows (the 64 MiB budget before), 25 at 441 rows, 19 at
one chunk of 2,048, for +0.5 and +2.9 GiB of peak (BENCHMARKS.md, "Chunked logprobs at a real
vocabulary"): 256 MiB is the knee."""
MIN_CHUNK_ROWS = 16
DEFAULT_KEEP_BYTES = 2.0
"""Default `keep_bytes`: bytes per logit that the forward may spend keeping chunks' logits for the
backward. 2 keeps every chunk of bfloat16 logits and half of float32 ones: at most 1/6 of the naive
forward + backward's >= 12 bytes per logit (float32 logits, log-softmax and gradient)."""
DEFAULT_KEEP_LIMIT = 1 << 30
"""Default `keep_limit`: bytes the kept logits may take in all, whatever `keep_bytes` allows. Keeping
saves at most the backward's recompute, one matmul of four: at Qwen2.5-7B's head, 4,096 tokens, all 5
chunks kept (0.9 GiB) gave 34-40 CPU s against 39 for none (within this machine's noise); at 32k
tokens keeping them all would hold 9.3 GiB of bfloat16 logits (BENCHMARKS.md)."""


class TopKScores(NamedTuple):
    """Beyond the target token, from the same chunked pass (no gradient)."""

    logp_at: torch.Tensor | None
    """(N, K) float32 log-probability of each given id (`topk_ids`: the engine's top-K); -inf where
    the id is padding (-1); None unless ids were given."""
    ids: torch.Tensor | None
    """(N, K) int64: this distribution's own top-K ids, most probable first; None unless `top_k` > 0."""


class TokenLogprobs(NamedTuple):
    logp: torch.Tensor
    """float32 log-probability of each target token."""
    entropy: torch.Tensor | None
    """float32 entropy (nats) of each position's distribution; None unless asked for."""
    topk: TopKScores | None = None
    """Log-probabilities at given ids and the own top-K ids (`top_k`, `topk_ids`); None unless asked for."""


def default_chunk_size(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's float32 logits fit in `budget_bytes` (at least 16)."""
    return max(MIN_CHUNK_ROWS, budget_bytes // (4 * vocab_size))


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not a finite number > 0 (ConfigError)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be a finite number > 0, got {temperature!r}")


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tf, chunk_size, with_entropy, topk_ids, top_k, keep):
        """Outputs: logp (N,), then entropy (N,) if asked, logp at `topk_ids` (N, K) if given, own
        top-`top_k` ids (N, k) if top_k > 0; the last two are non-differentiable. `keep`: (keep_bytes,
        keep_limit). Float32 matmuls at full precision (`exact_fp32`)."""
        with exact_fp32():
            return _ChunkedLogprobs._forward(ctx, hidden, weight, bias, targets, tf, chunk_size, with_entropy,
                                             topk_ids, top_k, keep)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, tf, chunk_size, with_entropy, topk_ids, top_k, keep):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        at = None if topk_ids is None else logp.new_empty(topk_ids.shape)  # (N, K)
        own = None if not top_k else torch.empty(n, top_k, dtype=torch.int64, device=hidden.device)  # (N, k)
        want_topk = at is not None or own is not None
        num_chunks = -(-n // chunk_size)
        chunk_bytes = min(chunk_size, n) * weight.shape[0] * weight.element_size()
        keeping = num_kept(keep[0], weight.element_size(), num_chunks, chunk_bytes, keep[1]) \
            if any(ctx.needs_input_grad[:3]) else 0
        kept = []  # raw logits of the first `keeping` chunks, in the weight dtype
        for i, a in enumerate(range(0, n, chunk_size)):
            s = slice(a, a + chunk_size)
            z, x = chunk_logits(hidden[s], weight, bias, tf, keep=i < keeping, overwritten=with_entropy)
            if x is not None:
                kept.append(x)
            ids = None if topk_ids is None else topk_ids[s]
            lp, ls, en, (at_c, own_c) = chunk_forward(z, targets[s], with_entropy, (ids, top_k) if want_topk else None)
            logp[s], lse[s] = lp, ls
            if with_entropy:
                ent[s] = en
            if at is not None:
                at[s] = at_c
            if own is not None:
                own[s] = own_c
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.tf, ctx.chunk_size, ctx.with_entropy, ctx.kept = tf, chunk_size, with_entropy, kept
        extra = tuple(x for x in (at, own) if x is not None)
        ctx.mark_non_differentiable(*extra)
        out = (logp, ent, *extra) if with_entropy else (logp, *extra)
        return out if len(out) > 1 else logp

    @staticmethod
    def backward(ctx, grad_logp, *grads):
        with exact_fp32():
            return _ChunkedLogprobs._backward(ctx, grad_logp, *grads)

    @staticmethod
    def _backward(ctx, grad_logp, *grads):
        grad_ent = grads[0] if ctx.with_entropy else None  # the top-k outputs have no gradient
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        part = None  # the weight dtype's (V, H) product of one chunk
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for i, a in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            s = slice(a, a + ctx.chunk_size)
            h = hidden[s].to(weight.dtype)
            if i < len(ctx.kept) and ctx.kept[i] is not None:  # consumed: a second backward recomputes
                z, ctx.kept[i] = kept_logits(ctx.kept[i], ctx.tf), None
            else:
                z = chunk_logits(h, weight, bias, ctx.tf)[0]
            g_ent = None if grad_ent is None else (ent[s], grad_ent[s])
            gz = chunk_grad(z, ctx.tf, targets[s], lse[s], grad_logp[s], g_ent)
            gx = gz.to(weight.dtype)  # (c, V)
            if need_h:
                grad_h[s] = gx @ weight
            if need_w and gx.dtype == torch.float32:
                grad_w.addmm_(gx.T, h)
            elif need_w:  # matmul in the weight dtype, as the naive backward; summed over chunks in float32
                part = torch.mm(gx.T, h, out=part)  # (V, H), one buffer for every chunk: no V x H allocation each
                grad_w.add_(part)
            if need_b:
                grad_b.add_(gz.sum(dim=0))
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


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
    top_k: int = 0,
    topk_ids: torch.Tensor | None = None,
    keep_bytes: float = DEFAULT_KEEP_BYTES,
    keep_limit: float = DEFAULT_KEEP_LIMIT,
) -> TokenLogprobs:
    """Log-probabilities of `targets` under the logits `hidden @ weight.T (+ bias)`, chunked over tokens.

    Equivalent to the naive

    ```python
    x = (hidden @ weight.T + bias).float() * logit_scale                 # (N, V)
    if logit_softcap: x = logit_softcap * torch.tanh(x / logit_softcap)
    logps = (x / temperature).log_softmax(-1)                            # (N, V) float32
    logp = logps.gather(-1, targets[:, None]).squeeze(-1)                # (N,)
    entropy = -(logps.exp() * logps).sum(-1)                             # (N,)
    logp_at = logps.gather(-1, topk_ids.clamp(min=0)).masked_fill(topk_ids < 0, -inf)  # (N, K)
    ids = logps.topk(top_k, dim=-1).indices                              # (N, top_k)
    ```

    but only `chunk_size` rows of logits exist at a time, in the forward and in the backward (which
    recomputes them). The matmul runs in `weight`'s dtype (as the model's LM head does), everything
    after it in float32. Float32 matmuls run at IEEE precision even where TF32 (or oneDNN's bfloat16
    passes on CPU) is on for the rest of the process (`exact_fp32`). Differentiable in `hidden`,
    `weight` and `bias`.

    Args:
        hidden: (N, H) final hidden states (after the final norm): one row per scored token.
        weight: (V, H) LM head weight. bias: (V,) or None.
        targets: (N,) int64 token ids; row i is scored on `targets[i]` (no shift here).
        temperature: sampling temperature (> 0, finite); the logits are divided by it.
        logit_scale: multiplies the logits first (Cohere `logit_scale`; Granite: 1 / `logits_scaling`).
        logit_softcap: Gemma-style `final_logit_softcapping`, applied after the scale; None for none.
        chunk_size: rows per chunk; default `default_chunk_size(V)` (256 MiB of float32 logits).
        with_entropy: also return each row's entropy.
        top_k: also return each row's own `top_k` most probable ids (0: no).
        topk_ids: (N, K) int64 ids (the engine's top-K, -1 = padding) to return the logprobs of.
        keep_bytes: memory for time: bytes per logit (N x V of them) that the forward may spend
            keeping the first chunks' raw logits (in `weight`'s dtype) for the backward, which then
            skips their recomputation (one matmul of the four per chunk). Default 2: all chunks of
            bfloat16 logits, half of float32 ones; 0 recomputes all. Same results either way;
            nothing is kept without grad.
        keep_limit: bytes the kept logits may take in all (default 1 GiB), whatever `keep_bytes`
            allows: at a 151,936 vocabulary 32k bfloat16 tokens' logits are 9.3 GiB, which `keep_bytes`
            alone would keep.

    Returns:
        `TokenLogprobs(logp, entropy, topk)`: float32 (N,) tensors; entropy is None unless asked for;
        `topk` is `TopKScores(logp_at, ids)` (no gradient) when `top_k` or `topk_ids` is given, else None.
    """
    check_temperature(temperature)
    if not (isinstance(keep_bytes, (int, float)) and math.isfinite(keep_bytes) and keep_bytes >= 0):
        raise ConfigError(f"keep_bytes must be a number of bytes per logit >= 0, got {keep_bytes!r}")
    if not (isinstance(keep_limit, (int, float)) and keep_limit >= 0):
        raise ConfigError(f"keep_limit must be a number of bytes >= 0 (inf: none), got {keep_limit!r}")
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
    ids = _check_topk(top_k, topk_ids, hidden.shape[0], weight.shape[0])
    ids = None if ids is None else ids.to(hidden.device)
    tf = Transform(float(logit_scale), logit_softcap, float(temperature))
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    keep = float(keep_bytes) if torch.is_grad_enabled() else 0.0
    out = _ChunkedLogprobs.apply(hidden, weight, bias, targets.long(), tf, chunk, with_entropy, ids, top_k,
                                 (keep, float(keep_limit)))
    out = list(out) if isinstance(out, tuple) else [out]
    logp, ent = out.pop(0), out.pop(0) if with_entropy else None
    if ids is None and not top_k:
        return TokenLogprobs(logp, ent)
    at = out.pop(0) if ids is not None else None
    return TokenLogprobs(logp, ent, TopKScores(at, out.pop(0) if top_k else None))


def _check_topk(top_k: int, topk_ids: torch.Tensor | None, n: int, vocab: int) -> torch.Tensor | None:
    """`topk_ids` as int64 after checking `top_k` in [0, V] and the ids (N, K) in [-1, V)."""
    if not (isinstance(top_k, int) and 0 <= top_k <= vocab):
        raise ConfigError(f"top_k must be an integer in [0, vocab size {vocab}], got {top_k!r}")
    if topk_ids is None:
        return None
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n:
        raise InputError(f"topk_ids must be (N, K) with N = {n} scored rows, got {tuple(topk_ids.shape)}")
    if topk_ids.numel() and (int(topk_ids.max()) >= vocab or int(topk_ids.min()) < -1):
        raise InputError(f"topk_ids must hold token ids in [0, {vocab}) or -1 for padding")
    return topk_ids.long()
