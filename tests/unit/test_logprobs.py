"""`rlcheck.trainers.logprobs`: chunked token logprobs equal the naive log_softmax + gather, values and grads."""

from __future__ import annotations

import pytest
import torch

from rlcheck.errors import ConfigError, InputError
from rlcheck.synthetic.streams import tiny_causal_lm
from rlcheck.trainers.logprobs import chunked_token_logprobs, default_chunk_size, token_logprobs

N, H, V = 301, 64, 512


def naive(hidden, weight, targets, bias=None, temperature=1.0, scale=1.0, softcap=None):
    """The reference: full float32 log-softmax, then gather; entropy from the same tensor."""
    x = torch.nn.functional.linear(hidden, weight, bias).float() * scale  # (N, V)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    logps = (x / temperature).log_softmax(-1)
    return logps.gather(-1, targets[:, None]).squeeze(-1), -(logps.exp() * logps).sum(-1)


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    return hidden, weight, bias, torch.randint(0, V, (N,), generator=g)


def tiny_llama():
    return tiny_causal_lm("llama", vocab_size=V).eval()


def tiny_granite_hybrid():
    return tiny_causal_lm("hybrid", vocab_size=V, num_local_experts=4, num_experts_per_tok=2, logits_scaling=4.0).eval()


def model_reference(model, input_ids, temperature=1.0):
    """Shifted logprobs and entropies from the model's own full logits."""
    logps = (model(input_ids).logits.float() / temperature).log_softmax(-1)[:, :-1]  # (B, T-1, V)
    return logps.gather(-1, input_ids[:, 1:, None]).squeeze(-1), -(logps.exp() * logps).sum(-1)


class TestChunkedTokenLogprobs:
    @pytest.mark.parametrize("chunk_size", [1, 64, 100, N, 1000])
    def test_equals_naive_fp32(self, chunk_size):
        """float32: logp and entropy equal the naive version to 1e-6 relative, for any chunking."""
        hidden, weight, bias, targets = inputs()
        got = chunked_token_logprobs(
            hidden, weight, targets, bias=bias, chunk_size=chunk_size, with_entropy=True
        )
        want = naive(hidden, weight, targets, bias)
        torch.testing.assert_close(got.logp, want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.entropy, want[1], rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize(
        ("temperature", "scale", "softcap"), [(0.6, 1.0, None), (1.7, 0.25, None), (0.9, 2.0, 5.0)]
    )
    def test_temperature_scale_softcap(self, temperature, scale, softcap):
        """Temperature, logit scale and softcap act as in the naive formula."""
        hidden, weight, _, targets = inputs()
        got = chunked_token_logprobs(
            hidden,
            weight,
            targets,
            temperature=temperature,
            logit_scale=scale,
            logit_softcap=softcap,
            chunk_size=64,
            with_entropy=True,
        )
        want = naive(hidden, weight, targets, temperature=temperature, scale=scale, softcap=softcap)
        torch.testing.assert_close(got.logp, want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.entropy, want[1], rtol=1e-6, atol=1e-6)

    def test_bf16_close_to_naive(self):
        """bfloat16 weights: same bf16 matmul, float32 after it, so within 1e-5 of the naive result."""
        hidden, weight, bias, targets = inputs(torch.bfloat16)
        got = chunked_token_logprobs(hidden, weight, targets, bias=bias, chunk_size=64, with_entropy=True)
        want = naive(hidden, weight, targets, bias)
        torch.testing.assert_close(got.logp, want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.entropy, want[1], rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize(("with_entropy", "softcap"), [(False, None), (True, None), (True, 4.0)])
    def test_gradients_equal_naive(self, with_entropy, softcap):
        """Gradients in hidden, weight and bias equal the naive version's, entropy term included."""
        hidden, weight, bias, targets = inputs()
        g = torch.Generator().manual_seed(1)
        g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
        got = chunked_token_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=0.8,
            logit_softcap=softcap,
            chunk_size=100,
            with_entropy=with_entropy,
        )
        want = naive(hidden, weight, targets, bias, temperature=0.8, softcap=softcap)
        loss_got = (got.logp * g_logp).sum() + ((got.entropy * g_ent).sum() if with_entropy else 0)
        loss_want = (want[0] * g_logp).sum() + ((want[1] * g_ent).sum() if with_entropy else 0)
        for a, b in zip(
            torch.autograd.grad(loss_got, (hidden, weight, bias)),
            torch.autograd.grad(loss_want, (hidden, weight, bias)),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())

    def test_bf16_gradients_close(self):
        """bfloat16: gradients within bf16 rounding (2e-2 relative) of the naive version's."""
        hidden, weight, _, targets = inputs(torch.bfloat16)
        got = chunked_token_logprobs(hidden, weight, targets, chunk_size=64).logp.sum()
        want = naive(hidden, weight, targets)[0].sum()
        for a, b in zip(
            torch.autograd.grad(got, (hidden, weight)),
            torch.autograd.grad(want, (hidden, weight)),
            strict=True,
        ):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.abs().max().item())

    def test_frozen_weight(self):
        """A weight without grad (reference model) gets none; hidden still does."""
        hidden, weight, _, targets = inputs()
        weight = weight.detach()
        chunked_token_logprobs(hidden, weight, targets, chunk_size=64).logp.sum().backward()
        assert weight.grad is None and hidden.grad is not None

    @pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
    def test_bad_temperature(self, temperature):
        """A temperature that is not a finite positive number raises ConfigError (a ValueError)."""
        hidden, weight, _, targets = inputs()
        with pytest.raises(ConfigError, match="temperature"):
            chunked_token_logprobs(hidden, weight, targets, temperature=temperature)
        assert issubclass(ConfigError, ValueError)

    def test_bad_shapes(self):
        """Targets that do not match the hidden rows raise InputError."""
        hidden, weight, _, targets = inputs()
        with pytest.raises(InputError, match="targets"):
            chunked_token_logprobs(hidden, weight, targets[:-1])

    def test_default_chunk_size(self):
        """The default chunk holds 256 MiB of float32 logits, and at least 16 rows."""
        assert default_chunk_size(32768) == 2048
        assert default_chunk_size(131072) == 512
        assert default_chunk_size(151936) == 441
        assert default_chunk_size(10**8) == 16


class TestTokenLogprobs:
    @pytest.mark.parametrize("make_model", [tiny_llama, tiny_granite_hybrid])
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_equals_model_logits(self, make_model, temperature):
        """Shifted logprobs and entropies equal the model's own logits' log_softmax (Granite: logits_scaling)."""
        model = make_model()
        input_ids = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            got = token_logprobs(model, input_ids, temperature=temperature, with_entropy=True, chunk_size=7)
            want = model_reference(model, input_ids, temperature)
        assert got.logp.shape == (2, 18)
        torch.testing.assert_close(got.logp, want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.entropy, want[1], rtol=1e-5, atol=1e-5)

    def test_explicit_targets_no_shift(self):
        """Given targets, position t is scored on targets[:, t]."""
        model = tiny_llama()
        input_ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
        targets = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = token_logprobs(model, input_ids, targets).logp
            want = model(input_ids).logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_packed_equals_separate(self):
        """Packed sequences with cu_seqlens: each sequence's L-1 shifted logprobs, as if run alone."""
        model = tiny_llama()
        g = torch.Generator().manual_seed(5)
        seqs = [torch.randint(0, V, (1, n), generator=g) for n in (7, 12, 3)]
        with torch.no_grad():
            want = torch.cat([model_reference(model, s)[0][0] for s in seqs])
            got = token_logprobs(model, torch.cat(seqs, 1), cu_seqlens=torch.tensor([0, 7, 19, 22])).logp
        assert got.shape == (22 - 3,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_gradients_equal_model(self):
        """Backprop through token_logprobs gives the parameter gradients of the full-logits version."""
        model = tiny_llama()
        input_ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(6))
        params = [p for p in model.parameters()]
        got = torch.autograd.grad(token_logprobs(model, input_ids, chunk_size=5).logp.sum(), params)
        want = torch.autograd.grad(model_reference(model, input_ids)[0].sum(), params)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())

    def test_forward_restored(self):
        """After the call the model computes ordinary logits again."""
        model = tiny_llama()
        input_ids = torch.randint(0, V, (1, 5))
        with torch.no_grad():
            token_logprobs(model, input_ids)
            assert model(input_ids).logits.shape == (1, 5, V)
        assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__

    def test_bad_inputs(self):
        """Bad temperature, mismatched targets and padded packed input raise ValueErrors."""
        model, input_ids = tiny_llama(), torch.randint(0, V, (2, 5))
        with pytest.raises(ConfigError):
            token_logprobs(model, input_ids, temperature=0)
        with pytest.raises(InputError):
            token_logprobs(model, input_ids, input_ids[:, :-1])
        with pytest.raises(InputError):
            token_logprobs(model, input_ids, cu_seqlens=torch.tensor([0, 5, 10]))
