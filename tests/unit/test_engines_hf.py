"""The HF reference's logits: only the compared (response) positions get them, a chunk at a time, from
the decoder's hidden states and the model's own LM head and logit transform; a model whose head cannot
be split off is scored through its own forward (`rlcheck.engines.hf`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlcheck.engines import hf
from rlcheck.engines.hf import HFScorer, HFScorerConfig
from rlcheck.synthetic.streams import tiny_causal_lm

VOCAB = 512
PROMPTS, RESPONSES = [[5, 6, 7], [9, 3], [4] * 11], [[8, 9, 10, 11], [1] * 9, [2, 3]]


def plain(model, prompt, response, temperature):
    """log_softmax(logits / T) of the model's own forward, at each response token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float() / temperature
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return torch.log_softmax(logits, -1)[rows, torch.tensor(response)].numpy()


def gemma2():
    import transformers

    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=3.0)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg)


class TestLogitsOnlyWhereCompared:
    @pytest.mark.parametrize("make", [lambda: tiny_causal_lm("llama", vocab_size=VOCAB),
                                      lambda: tiny_causal_lm("mamba2", vocab_size=VOCAB),
                                      lambda: tiny_causal_lm("hybrid", vocab_size=VOCAB, logits_scaling=4.0), gemma2],
                             ids=["llama", "mamba2", "granite-hybrid-logits-scaling", "gemma2-softcap"])
    def test_split_head_equals_the_models_forward(self, make):
        """Decoder + LM head (+ Granite's logits_scaling, Gemma2's softcap) give the model's own logprobs."""
        model = make()
        scorer = HFScorer(HFScorerConfig(model="in-process"), model=model)
        assert scorer.split is not None
        for p, r, lp in zip(PROMPTS, RESPONSES, scorer.score(PROMPTS, RESPONSES, temperature=0.7), strict=True):
            np.testing.assert_allclose(lp, plain(model, p, r, 0.7), atol=2e-6)

    @pytest.mark.parametrize("arch", ["llama", "mamba2"])
    def test_bf16_model_splits_its_head(self, arch):
        """A bf16 model: the decoder's last hidden states reach the LM head in its dtype, as the model's own
        forward casts them (a bf16 Mamba2's final norm returns fp32: the head's matmul refused it)."""
        model = tiny_causal_lm(arch, vocab_size=VOCAB).to(torch.bfloat16)
        scorer = HFScorer(HFScorerConfig(model="in-process", dtype="bfloat16"), model=model)
        assert scorer.split is not None
        for p, r, lp in zip(PROMPTS, RESPONSES, scorer.score(PROMPTS, RESPONSES), strict=True):
            np.testing.assert_allclose(lp, plain(model, p, r, 1.0), atol=0.05)

    def test_lm_head_sees_response_positions_in_chunks(self, monkeypatch):
        """With a 3-row chunk budget the LM head runs on at most 3 rows at a time and on the response
        positions only: 15 rows in all for 4 + 9 + 2 response tokens (no prompt position, no padding)."""
        model = tiny_causal_lm("llama", vocab_size=VOCAB)
        scorer = HFScorer(HFScorerConfig(model="in-process"), model=model)
        monkeypatch.setattr(hf, "LOGIT_CHUNK_BYTES", 3 * 4 * VOCAB)
        rows = []
        model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
        scorer.score(PROMPTS, RESPONSES)
        assert max(rows) <= 3 and sum(rows) == sum(map(len, RESPONSES))

    def test_unsplittable_head_falls_back_to_the_forward(self):
        """A config transform the model does not apply (logit_scale on a Llama) fails the probe: a warning,
        and the scores come from the model's own forward, still right."""
        model = tiny_causal_lm("llama", vocab_size=VOCAB)
        model.config.logit_scale = 2.0
        with pytest.warns(RuntimeWarning, match="cannot split"):
            scorer = HFScorer(HFScorerConfig(model="in-process"), model=model)
        assert scorer.split is None
        np.testing.assert_allclose(scorer.score(PROMPTS[:1], RESPONSES[:1])[0], plain(model, PROMPTS[0], RESPONSES[0], 1.0),
                                   atol=2e-6)
