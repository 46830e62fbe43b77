"""Trainer-side token logprobs (and entropies) without the [tokens, vocab] float32 log-softmax.

The usual trainer code, `(hidden @ W.T).float().log_softmax(-1).gather(-1, targets)`, holds the
logits and a float32 copy of the log-softmax for every token at once: 8k tokens x 128k vocab is
4 GiB per [tokens, vocab] float32 tensor. Here the tokens are processed in chunks, from the final
hidden states and the LM head weight, so only one chunk's logits exist at a time; the backward
recomputes each chunk's logits instead of keeping them.

    logp, _ = chunked_token_logprobs(hidden, lm_head.weight, targets)              # (N,)
    logp, ent = token_logprobs(model, input_ids, temperature=0.7, with_entropy=True)  # (B, T-1)

`token_logprobs` runs the model's own forward (so FSDP2 `fully_shard` and DeepSpeed ZeRO-3 hooks
gather the sharded weights, and register their backward hooks) with two forwards swapped in for the
duration of the call: the model's (backbone, then LM head, no full logits) and the LM head's (the
chunked computation, under the LM head's hooks). torch is the only dependency; transformers models
are used through their methods (`get_decoder`, `get_output_embeddings`) and config attributes.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
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


def _check_temperature(temperature: float) -> None:
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
    _check_temperature(temperature)
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


# ---------------------------------------------------------------- model level


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DeepSpeed / DDP wrappers (`.module`); FSDP2 wraps in place."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def logit_transform(model: torch.nn.Module) -> tuple[float, float | None]:
    """(logit_scale, logit_softcap) that the model applies to its LM head output, from its config:
    Granite `logits_scaling` (divides), Cohere `logit_scale` (multiplies), Gemma `final_logit_softcapping`."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale = 1.0 / float(getattr(cfg, "logits_scaling", None) or 1.0)
    scale *= float(getattr(cfg, "logit_scale", None) or 1.0)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


@contextmanager
def _forward_swapped(module: torch.nn.Module, forward):
    """`module(...)` runs `forward` (with the module's hooks) until exit; an instance `forward` set by
    someone else (e.g. accelerate hooks) is restored."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def _scored_rows(input_ids: torch.Tensor, targets: torch.Tensor | None, cu_seqlens: torch.Tensor | None):
    """(rows of the flattened (B*T) positions to score or None for all, their targets, output shape).
    Without `targets`, the causal shift: row t predicts token t+1 of the same sequence (the same row of
    the batch, or between `cu_seqlens` boundaries)."""
    if targets is not None:
        if targets.shape != input_ids.shape:
            raise InputError(
                f"targets must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(targets.shape)}"
            )
        return None, targets.reshape(-1), tuple(targets.shape)
    b, t = input_ids.shape
    pos = torch.arange(b * t, device=input_ids.device).view(b, t)
    if cu_seqlens is None:
        return pos[:, :-1].reshape(-1), input_ids[:, 1:].reshape(-1), (b, t - 1)
    last = torch.zeros(t, dtype=torch.bool, device=input_ids.device)
    last[cu_seqlens[1:].to(input_ids.device) - 1] = True  # the last token of a sequence predicts nothing
    rows = pos[0][~last]
    return rows, input_ids[0][rows + 1], (-1,)


def _positions_from_cu_seqlens(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """(1, T) int64 position of every token cu_seqlens[0]:cu_seqlens[-1] inside its sequence (int32
    cu_seqlens, the flash-attn habit, are widened first)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])  # (T,)
    return (torch.arange(int(cu[0]), int(cu[-1]), device=device) - starts)[None]


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> TokenLogprobs:
    """Token logprobs of a causal LM (plain, FSDP2 `fully_shard`-ed or a DeepSpeed engine), equal to
    `log_softmax(model(input_ids).logits.float() / temperature)` gathered at the targets, without the
    full logits. Differentiable; the wrappers' hooks gather and re-gather sharded weights as usual.

    Which token is scored where:
    - `targets` given (same shape as `input_ids`): position t is scored on `targets[..., t]`, no
      shift; returns the shape of `targets`.
    - `targets` None, padded / unpacked `input_ids` (B, T): the causal shift, position t scored on
      `input_ids[:, t+1]`; returns (B, T-1). Padding positions hold values to mask out.
    - `targets` None, packed `input_ids` (1, T) with `cu_seqlens` (num_seqs + 1,): the shift within
      each sequence; returns (T - num_seqs,): each sequence's L - 1 logprobs, concatenated.
    With `cu_seqlens`, `position_ids` default to restarting at every sequence (HF then masks attention
    between packed sequences); `attention_mask` must then be None.
    """
    _check_temperature(temperature)
    hf = _unwrap(model)
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1 or attention_mask is not None:
            raise InputError(
                "packed input (cu_seqlens) needs input_ids of shape (1, T) and no attention_mask"
            )
        if position_ids is None:
            position_ids = _positions_from_cu_seqlens(cu_seqlens, input_ids.device)
    rows, tgt, shape = _scored_rows(input_ids, targets, cu_seqlens)
    lm_head, decoder = hf.get_output_embeddings(), hf.get_decoder()
    if lm_head is None or decoder is hf:
        raise InputError(
            f"{type(hf).__name__} has no LM head / decoder (get_output_embeddings, get_decoder): "
            "token_logprobs needs a causal LM such as *ForCausalLM"
        )
    scale, softcap = logit_transform(hf)

    def head_forward(hidden):  # runs as lm_head(hidden): weight gathered by the wrapper's hooks
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
        return tuple(
            chunked_token_logprobs(
                flat if rows is None else flat[rows],
                lm_head.weight,
                tgt,
                bias=lm_head.bias,
                temperature=temperature,
                logit_scale=scale,
                logit_softcap=softcap,
                chunk_size=chunk_size,
                with_entropy=with_entropy,
            )
        )[: 1 + with_entropy]

    def model_forward(input_ids, attention_mask=None, position_ids=None):
        out = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return lm_head(out.last_hidden_state)

    with _forward_swapped(lm_head, head_forward), _forward_swapped(hf, model_forward):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return TokenLogprobs(out[0].view(shape), out[1].view(shape) if with_entropy else None)
