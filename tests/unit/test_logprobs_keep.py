"""`rlcheck.trainers.logprobs` `keep_bytes`: chunks whose logits the forward keeps give the backward the
same gradients as chunks it recomputes, with every transform and the entropy term."""

from __future__ import annotations

import pytest
import torch

from rlcheck.errors import ConfigError
from rlcheck.synthetic.streams import tiny_causal_lm
from rlcheck.trainers.chunk_math import num_kept as _num_kept
from rlcheck.trainers.logprobs import chunked_token_logprobs, token_logprobs

N, H, V = 203, 32, 256


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (0.5 * torch.randn(V, H, generator=g)).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    return hidden, weight, bias, torch.randint(0, V, (N,), generator=g)


def grads(keep_bytes, dtype=torch.float32, with_entropy=True, retain=False, **kw):
    """(logp, entropy, grad hidden, grad weight, grad bias) of a weighted loss; twice if `retain`."""
    hidden, weight, bias, targets = inputs(dtype)
    leaves = [x.requires_grad_() for x in (hidden, weight, bias)]
    out = chunked_token_logprobs(
        hidden, weight, targets, bias=bias, chunk_size=40, with_entropy=with_entropy, keep_bytes=keep_bytes, **kw
    )
    g = torch.Generator().manual_seed(1)
    loss = (out.logp * torch.randn(N, generator=g)).sum()
    if with_entropy:
        loss = loss + (out.entropy * torch.randn(N, generator=g)).sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=retain)
    again = torch.autograd.grad(loss, leaves) if retain else None
    return (out.logp.detach(), out.entropy, *first), again


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6 * y.abs().max().item())


class TestKeepBytes:
    @pytest.mark.parametrize("keep_bytes", [1.0, 2.0, 4.0, 100.0])
    @pytest.mark.parametrize(
        ("with_entropy", "kw"),
        [(False, {}), (True, {}), (True, {"temperature": 0.7, "logit_scale": 0.5}), (True, {"logit_softcap": 3.0}),
         (False, {"logit_softcap": 3.0, "top_k": 4})],
    )
    def test_kept_equals_recomputed_fp32(self, keep_bytes, with_entropy, kw):
        """float32: keeping a quarter, half or all of the chunks gives the recompute-everything results."""
        got, _ = grads(keep_bytes, with_entropy=with_entropy, **kw)
        want, _ = grads(0.0, with_entropy=with_entropy, **kw)
        assert_same(got, want)

    @pytest.mark.parametrize("with_entropy", [False, True])
    def test_kept_equals_recomputed_bf16(self, with_entropy):
        """bfloat16: the kept bf16 matmul output is the recomputed one, so the gradients agree."""
        got, _ = grads(2.0, torch.bfloat16, with_entropy=with_entropy)
        want, _ = grads(0.0, torch.bfloat16, with_entropy=with_entropy)
        assert_same(got, want)

    def test_second_backward_recomputes(self):
        """The backward consumes the kept logits; a second backward (retain_graph) recomputes them."""
        first, again = grads(4.0, retain=True)
        assert_same(again, first[2:])

    def test_how_many_kept(self):
        """Rounded down within the budget: 2 bytes keep half the float32 chunks, all bfloat16 ones."""
        assert _num_kept(2.0, 4, 16) == 8
        assert _num_kept(2.0, 2, 16) == 16
        assert _num_kept(100.0, 4, 5) == 5
        assert _num_kept(1.0, 4, 3) == 0 and _num_kept(0.0, 2, 8) == 0

    def test_keep_limit_caps_the_kept_bytes(self, monkeypatch):
        """`keep_limit` caps the kept logits in bytes whatever `keep_bytes` allows: 16 bfloat16 chunks of
        2 MiB under a 5 MiB limit keep 2; the kernel keeps exactly what `num_kept` says, with the
        recompute-everything gradients; a bad limit is a ConfigError."""
        from rlcheck.trainers import chunked_logprobs as kernel

        assert _num_kept(2.0, 2, 16, chunk_bytes=2 << 20, keep_limit=5 << 20) == 2
        assert _num_kept(2.0, 4, 16, chunk_bytes=1 << 20, keep_limit=float("inf")) == 8
        kept = []
        real = kernel.chunk_logits
        monkeypatch.setattr(kernel, "chunk_logits", lambda *a, keep=False, **kw: kept.append(keep) or real(*a, keep=keep, **kw))
        chunk_bytes = 40 * V * 4  # 40 rows of float32 logits
        got, _ = grads(100.0, keep_limit=2 * chunk_bytes + 1)
        assert kept[:6] == [True, True, False, False, False, False]
        assert_same(got, grads(0.0)[0])
        hidden, weight, _, targets = inputs()
        with pytest.raises(ConfigError, match="keep_limit"):
            chunked_token_logprobs(hidden, weight, targets, keep_limit=-1)

    @pytest.mark.parametrize("keep_bytes", [-1.0, float("nan"), float("inf"), "2"])
    def test_bad_keep_bytes(self, keep_bytes):
        """A budget that is not a finite number >= 0 raises ConfigError."""
        hidden, weight, _, targets = inputs()
        with pytest.raises(ConfigError, match="keep_bytes"):
            chunked_token_logprobs(hidden, weight, targets, keep_bytes=keep_bytes)

    def test_token_logprobs_passes_it_on(self):
        """token_logprobs with everything kept gives the model's gradients of recomputing everything."""
        model = tiny_causal_lm("llama", vocab_size=V)
        ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
        per_keep = []
        for keep in (0.0, 4.0):
            model.zero_grad()
            token_logprobs(model, ids, chunk_size=5, keep_bytes=keep).logp.sum().backward()
            per_keep.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert_same(per_keep[1], per_keep[0])
