"""`rlcheck.trainers.logprobs` beyond the target token: the logprobs at given ids (the engine's top-K)
and the own top-K ids, from the same chunked pass, equal the naive full log_softmax + gather / topk."""

from __future__ import annotations

import pytest
import torch

from rlcheck.errors import ConfigError, InputError
from rlcheck.synthetic.streams import tiny_causal_lm
from rlcheck.trainers.logprobs import chunked_token_logprobs, token_logprobs

N, H, V, K = 203, 32, 256, 6


def naive_logps(hidden, weight, temperature=1.0, softcap=None):
    """(N, V) float32 log-softmax of the full logits: the reference."""
    x = torch.nn.functional.linear(hidden, weight).float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return (x / temperature).log_softmax(-1)


def naive_at(logps, ids):
    """The reference logprobs at `ids`, -inf at padding (-1)."""
    return logps.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, float("-inf"))


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[::7, -2:] = -1  # padding: the engine returned fewer than K
    return hidden, weight, targets, ids


class TestChunkedTopK:
    @pytest.mark.parametrize(("temperature", "softcap", "chunk_size"), [(1.0, None, 16), (0.7, None, 64), (1.3, 4.0, N)])
    def test_equals_naive(self, temperature, softcap, chunk_size):
        """Logprobs at the ids and the own top-K ids equal the naive full log-softmax's, padding -inf."""
        hidden, weight, targets, ids = inputs()
        got = chunked_token_logprobs(hidden, weight, targets, temperature=temperature, logit_softcap=softcap,
                                     chunk_size=chunk_size, top_k=K, topk_ids=ids)
        logps = naive_logps(hidden, weight, temperature, softcap)
        want = naive_at(logps, ids)
        assert got.topk.logp_at.dtype == torch.float32 and got.topk.ids.dtype == torch.int64
        assert torch.equal(torch.isinf(got.topk.logp_at), ids < 0)
        torch.testing.assert_close(got.topk.logp_at[ids >= 0], want[ids >= 0], rtol=1e-6, atol=1e-6)
        assert torch.equal(got.topk.ids, logps.topk(K, dim=-1).indices)

    def test_only_what_is_asked(self):
        """Without top_k or ids `topk` is None; with one of them the other field is None."""
        hidden, weight, targets, ids = inputs()
        assert chunked_token_logprobs(hidden, weight, targets).topk is None
        assert chunked_token_logprobs(hidden, weight, targets, top_k=3).topk.logp_at is None
        only_ids = chunked_token_logprobs(hidden, weight, targets, topk_ids=ids, with_entropy=True)
        assert only_ids.topk.ids is None and only_ids.entropy is not None

    @pytest.mark.parametrize("with_entropy", [False, True])
    def test_gradient_unchanged(self, with_entropy):
        """The gradient of logp (and entropy) is the same with the top-K outputs as without; they have none."""
        hidden, weight, targets, ids = inputs()
        grads = []
        for kw in ({}, {"top_k": K, "topk_ids": ids}):
            h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
            out = chunked_token_logprobs(h, w, targets, chunk_size=50, with_entropy=with_entropy, **kw)
            loss = out.logp.sum() + (out.entropy.sum() if with_entropy else 0.0)
            loss.backward()
            grads.append((h.grad, w.grad))
            if kw:
                assert not out.topk.logp_at.requires_grad and not out.topk.ids.requires_grad
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)

    def test_bad_arguments(self):
        """A top_k past the vocabulary, misshapen ids or ids out of range are refused."""
        hidden, weight, targets, ids = inputs()
        with pytest.raises(ConfigError, match="top_k"):
            chunked_token_logprobs(hidden, weight, targets, top_k=V + 1)
        with pytest.raises(InputError, match="topk_ids must be"):
            chunked_token_logprobs(hidden, weight, targets, topk_ids=ids[:-1])
        with pytest.raises(InputError, match="token ids in"):
            chunked_token_logprobs(hidden, weight, targets, topk_ids=ids.clamp(max=0) + V)


class TestTokenLogprobsTopK:
    def test_shifted_batch(self):
        """(B, T-1, K) ids: the logprobs at them and the own top-K equal the model's full logits'."""
        model = tiny_causal_lm("llama", vocab_size=V).eval()
        g = torch.Generator().manual_seed(1)
        input_ids = torch.randint(0, V, (3, 17), generator=g)
        ids = torch.randint(-1, V, (3, 16, K), generator=g)
        with torch.no_grad():
            got = token_logprobs(model, input_ids, temperature=0.8, top_k=K, topk_ids=ids)
            logps = (model(input_ids).logits.float() / 0.8).log_softmax(-1)[:, :-1]  # (B, T-1, V)
        assert got.topk.logp_at.shape == (3, 16, K) and got.topk.ids.shape == (3, 16, K)
        want = naive_at(logps, ids)
        torch.testing.assert_close(got.topk.logp_at[ids >= 0], want[ids >= 0], rtol=1e-5, atol=1e-5)
        assert torch.isinf(got.topk.logp_at[ids < 0]).all()
        assert torch.equal(got.topk.ids, logps.topk(K, dim=-1).indices)

    def test_packed(self):
        """Packed (T - num_seqs, K) ids: each sequence's rows equal the same sequence scored alone."""
        model = tiny_causal_lm("llama", vocab_size=V).eval()
        g = torch.Generator().manual_seed(2)
        seqs = [torch.randint(0, V, (n,), generator=g) for n in (9, 5, 12)]
        ids = torch.randint(0, V, (sum(len(s) - 1 for s in seqs), K), generator=g)
        cu = torch.tensor([0, 9, 14, 26])
        with torch.no_grad():
            got = token_logprobs(model, torch.cat(seqs)[None], cu_seqlens=cu, top_k=2, topk_ids=ids)
            a = 0
            for s in seqs:
                alone = token_logprobs(model, s[None], top_k=2, topk_ids=ids[a : a + len(s) - 1][None])
                torch.testing.assert_close(got.topk.logp_at[a : a + len(s) - 1], alone.topk.logp_at[0], rtol=1e-5, atol=1e-5)
                assert torch.equal(got.topk.ids[a : a + len(s) - 1], alone.topk.ids[0])
                a += len(s) - 1

    def test_misshapen_ids(self):
        """ids not shaped as the scored logprobs + (K,) are refused with the shape expected."""
        model = tiny_causal_lm("llama", vocab_size=V).eval()
        with pytest.raises(InputError, match=r"\(2, 7\) \+ \(K,\)"):
            token_logprobs(model, torch.zeros(2, 8, dtype=torch.long), topk_ids=torch.zeros(2, 8, K, dtype=torch.long))


class TestPolicyTrainerTopK:
    @pytest.mark.parametrize(("arch", "packed"), [("llama", True), ("hybrid", False)])
    def test_equals_full_logits(self, tiny_model, arch, packed):
        """Over several micro-batches, packed or padded: logp as `logprobs`, the logprobs at the given
        ids and the own top-K as the model's full logits give them, per response token."""
        import numpy as np

        from rlcheck.trainers import PolicyTrainer, Sequences, TrainerConfig, plan_micro_batches

        model = str(tiny_model(arch))
        trainer = PolicyTrainer(TrainerConfig(model=model, backend="hf", micro_batch_tokens=40, temperature=0.9))
        assert trainer.packed is packed
        rng = np.random.default_rng(0)
        vocab = trainer.backend.module.config.vocab_size
        prompts = [rng.integers(3, vocab, rng.integers(2, 12)).tolist() for _ in range(7)]
        responses = [rng.integers(3, vocab, rng.integers(1, 15)).tolist() for _ in range(7)]
        ids = [rng.integers(-1, vocab, (len(r), K)) for r in responses]
        seqs = Sequences.build(prompts, responses)
        plan = plan_micro_batches(seqs, 1, 40)
        plain = trainer.logprobs(seqs, plan)
        asked = Sequences(seqs.prompts, seqs.responses, topk_ids=tuple(ids))
        got = trainer.topk_logprobs(asked, plan, top_k=4)
        hf = trainer.backend.module
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            lp, at, own = got[i]
            np.testing.assert_allclose(lp, plain[i], rtol=0, atol=1e-6)
            with torch.no_grad():
                logits = hf(torch.tensor([p + r])).logits[0].float() / 0.9
            logps = logits.log_softmax(-1)[len(p) - 1 : len(p) + len(r) - 1]  # (L, V)
            want = naive_at(logps, torch.from_numpy(ids[i])).numpy()
            np.testing.assert_allclose(at, want, rtol=1e-5, atol=1e-5)
            assert own.shape == (len(r), 4) and (own == logps.topk(4, dim=-1).indices.numpy()).all()
