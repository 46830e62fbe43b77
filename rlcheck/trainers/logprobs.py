"""Trainer-side token logprobs (and entropies) without the [tokens, vocab] float32 log-softmax.

The usual trainer code, `(hidden @ W.T).float().log_softmax(-1).gather(-1, targets)`, holds the
logits and a float32 copy of the log-softmax for every token at once: 8k tokens x 128k vocab is
4 GiB per [tokens, vocab] float32 tensor. Here the tokens are processed in chunks, from the final
hidden states and the LM head weight, so only one chunk's float32 logits exist at a time; the
backward recomputes the logits of the chunks the forward did not keep (`keep_bytes` per logit: by
default all of bfloat16 logits, half of float32 ones: 1/6 of the naive's 12 bytes per logit; and at
most `keep_limit` bytes in all, 1 GiB by default: at a 151,936 vocabulary 32k bfloat16 tokens' logits
are 9.3 GiB).

    logp, _ = chunked_token_logprobs(hidden, lm_head.weight, targets)              # (N,)
    logp, ent = token_logprobs(model, input_ids, temperature=0.7, with_entropy=True)  # (B, T-1)

`token_logprobs` runs the model's own forward (so FSDP2 `fully_shard` and DeepSpeed ZeRO-3 hooks
gather the sharded weights, and register their backward hooks) with two forwards swapped in for the
duration of the call: the model's (backbone, then LM head, no full logits) and the LM head's (the
chunked computation, under the LM head's hooks). torch is the only dependency; transformers models
are used through their methods (`get_decoder`, `get_output_embeddings`) and config attributes.
The chunked kernel itself, `chunked_token_logprobs`, is `rlcheck.trainers.chunked_logprobs`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rlcheck.errors import InputError
from rlcheck.trainers.chunked_logprobs import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_KEEP_BYTES,
    DEFAULT_KEEP_LIMIT,
    MIN_CHUNK_ROWS,
    TokenLogprobs,
    TopKScores,
    check_temperature,
    chunked_token_logprobs,
    default_chunk_size,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_KEEP_BYTES", "DEFAULT_KEEP_LIMIT", "MIN_CHUNK_ROWS", "TokenLogprobs",
           "TopKScores", "chunked_token_logprobs", "default_chunk_size", "logit_transform", "token_logprobs"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
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
    top_k: int = 0,
    topk_ids: torch.Tensor | None = None,
    keep_bytes: float = DEFAULT_KEEP_BYTES,
    keep_limit: float = DEFAULT_KEEP_LIMIT,
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

    Beyond the target token, from the same chunked pass and without gradient (`TokenLogprobs.topk`):
    `topk_ids`, shaped as the returned logprobs + (K,) (e.g. (B, T-1, K), or (T - num_seqs, K)
    packed; -1 = padding), gives each position's logprobs at those ids (the engine's top-K), -inf at
    padding; `top_k` > 0 gives each position's own top-`top_k` ids; both shaped as the output + (K,).
    `chunk_size`, `keep_bytes` and `keep_limit` (memory for time in the backward) are `chunked_token_logprobs`'.
    """
    check_temperature(temperature)
    hf = unwrap(model)
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1 or attention_mask is not None:
            raise InputError(
                "packed input (cu_seqlens) needs input_ids of shape (1, T) and no attention_mask"
            )
        if position_ids is None:
            position_ids = _positions_from_cu_seqlens(cu_seqlens, input_ids.device)
    rows, tgt, shape = _scored_rows(input_ids, targets, cu_seqlens)
    flat_ids = None if topk_ids is None else _flat_topk_ids(topk_ids, tgt.shape[0], shape)
    lm_head, decoder = hf.get_output_embeddings(), hf.get_decoder()
    if lm_head is None or decoder is hf:
        raise InputError(
            f"{type(hf).__name__} has no LM head / decoder (get_output_embeddings, get_decoder): "
            "token_logprobs needs a causal LM such as *ForCausalLM"
        )
    scale, softcap = logit_transform(hf)

    def head_forward(hidden):  # runs as lm_head(hidden): weight gathered by the wrapper's hooks
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
        out = chunked_token_logprobs(
            flat if rows is None else flat[rows],
            lm_head.weight,
            tgt,
            bias=lm_head.bias,
            temperature=temperature,
            logit_scale=scale,
            logit_softcap=softcap,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            top_k=top_k,
            topk_ids=flat_ids,
            keep_bytes=keep_bytes,
            keep_limit=keep_limit,
        )
        return (out.logp, *(x for x in (out.entropy, *(out.topk or ())) if x is not None))  # tensors only

    def model_forward(input_ids, attention_mask=None, position_ids=None):
        out = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return lm_head(out.last_hidden_state)

    with _forward_swapped(lm_head, head_forward), _forward_swapped(hf, model_forward):
        out = list(model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
    logp, ent = out.pop(0).view(shape), out.pop(0).view(shape) if with_entropy else None
    if topk_ids is None and not top_k:
        return TokenLogprobs(logp, ent)
    at = out.pop(0).view(*shape, flat_ids.shape[1]) if flat_ids is not None else None
    return TokenLogprobs(logp, ent, TopKScores(at, out.pop(0).view(*shape, top_k) if top_k else None))


def _flat_topk_ids(topk_ids: torch.Tensor, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`topk_ids` (output shape + (K,)) as (N, K) rows in the scored order (InputError if misshapen)."""
    if topk_ids.dim() < 2 or topk_ids.reshape(-1, topk_ids.shape[-1]).shape[0] != n or (
            shape != (-1,) and tuple(topk_ids.shape[:-1]) != shape):
        what = f"{shape} + (K,)" if shape != (-1,) else f"({n}, K)"
        raise InputError(f"topk_ids must be shaped as the scored logprobs + (K,): {what}, got {tuple(topk_ids.shape)}")
    return topk_ids.reshape(n, topk_ids.shape[-1])
