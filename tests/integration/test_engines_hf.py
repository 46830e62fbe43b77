"""HF reference scorer: batched scoring (packed or length-bucketed) equals one sequence at a time."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlcheck.engines.hf import HFScorer, HFScorerConfig, _groups  # noqa: E402
from rlcheck.errors import ConfigError, InputError  # noqa: E402
from rlcheck.synthetic.streams import tiny_causal_lm  # noqa: E402

VOCAB = 512


def tiny(arch: str):
    """A tiny random model of each family, built in-process."""
    return tiny_causal_lm(arch, vocab_size=VOCAB)


def data(n=14, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, rng.integers(1, 20)).tolist() for _ in range(n)]
    responses = [rng.integers(1, VOCAB, rng.integers(0, 40)).tolist() for _ in range(n)]
    return prompts, responses


@pytest.mark.slow
class TestHFScorer:
    @pytest.mark.parametrize("arch, packed", [("llama", True), ("mamba2", False), ("hybrid", False)])
    def test_batched_equals_one_at_a_time(self, arch, packed):
        """Packed (attention) or bucketed (Mamba) scoring gives each sequence's own logprobs."""
        cfg = HFScorerConfig(model="in-process", max_batch_tokens=160, max_row_tokens=160, pack=True)
        scorer = HFScorer(cfg, model=tiny(arch))
        assert scorer.packed is packed
        prompts, responses = data()
        got = scorer.score(prompts, responses, temperature=0.8)
        for p, r, lp in zip(prompts, responses, got, strict=True):
            assert lp.shape == (len(r),) and lp.dtype == np.float32
            np.testing.assert_allclose(lp, scorer.score_one(p, r, temperature=0.8), atol=5e-6)
        if packed:
            assert scorer.last_padding_fraction == 0.0

    @pytest.mark.parametrize("arch", ["llama", "hybrid"])
    def test_pads_on_cpu_by_default(self, arch):
        """On CPU the default batches by length with right padding (packing is for CUDA), and still agrees."""
        scorer = HFScorer(HFScorerConfig(model="in-process", max_batch_tokens=160), model=tiny(arch))
        assert scorer.packed is False
        prompts, responses = data()
        for p, r, lp in zip(prompts, responses, scorer.score(prompts, responses), strict=True):
            np.testing.assert_allclose(lp, scorer.score_one(p, r), atol=5e-6)

    def test_matches_plain_forward(self):
        """A score is log_softmax(logits / T) of the model's own forward at the next token."""
        model = tiny("llama")
        scorer = HFScorer(HFScorerConfig(model="in-process"), model=model)
        p, r = [5, 6, 7], [8, 9, 10, 11]
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0].float() / 0.7
        want = torch.log_softmax(logits, -1)[torch.arange(2, 6), torch.tensor(r)].numpy()
        np.testing.assert_allclose(scorer.score([p], [r], temperature=0.7)[0], want, atol=1e-6)

    def test_bad_input(self):
        """Empty prompts, mismatched lists and bad temperatures are InputErrors; bad dtype a ConfigError."""
        scorer = HFScorer(HFScorerConfig(model="in-process"), model=tiny("llama"))
        with pytest.raises(InputError, match="prompt is empty"):
            scorer.score([[]], [[1]])
        with pytest.raises(InputError, match="prompts for"):
            scorer.score([[1]], [])
        with pytest.raises(InputError, match="temperature"):
            scorer.score([[1]], [[2]], temperature=0.0)
        with pytest.raises(ConfigError):
            HFScorerConfig(model="x", dtype="int8")


class TestGroups:
    def test_budget_respected(self):
        """Groups never exceed the token budget except a single sequence longer than it."""
        lens = [50, 40, 40, 30, 10, 10, 300]
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        for packed in (True, False):
            groups = _groups(order, lens, 100, packed)
            assert sorted(i for g in groups for i in g) == list(range(len(lens)))
            for g in groups:
                cost = sum(lens[i] for i in g) if packed else len(g) * max(lens[i] for i in g)
                assert cost <= 100 or len(g) == 1
