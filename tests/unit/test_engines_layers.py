"""The one rule for a causal LM's decoder layers (`rlcheck.engines.layers`), used by the trainers'
sharding, the engine faults, localize and the MoE tools alike."""

from __future__ import annotations

import pytest
import torch

from rlcheck.engines.layers import decoder_layers
from rlcheck.errors import ConfigError


def llava():
    """A tiny LLaVA: a CLIP vision tower (2 layers, first in its modules) and a Llama text decoder (3 layers)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, vocab_size=64)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class _Stack(torch.nn.Module):
    def __init__(self, n: int, embed: bool):
        super().__init__()
        if embed:
            self.embed_tokens = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(n))


class VLLMShaped(torch.nn.Module):
    """vLLM's naming of a multimodal model without its interface: `visual.encoder.layers` first, then
    `language_model.model` (embed_tokens + layers)."""

    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Module()
        self.visual.encoder = _Stack(2, embed=False)
        self.language_model = torch.nn.Module()
        self.language_model.model = _Stack(5, embed=True)


class TestDecoderLayers:
    def test_llava_gives_the_text_decoder_not_the_vision_tower(self):
        """Two `layers` lists, the vision tower's first: the text decoder's 3 layers come back."""
        model = llava()
        assert [n for n, _ in model.named_modules() if n.endswith(".layers")][0].startswith("model.vision_tower")
        layers = decoder_layers(model)
        assert len(layers) == 3 and layers[0] is model.model.language_model.layers[0]

    def test_vllm_shaped_model_picks_the_list_beside_the_token_embedding(self):
        """Without get_decoder/get_language_model, the list beside `embed_tokens` wins over the vision encoder's."""
        model = VLLMShaped()
        assert decoder_layers(model) == list(model.language_model.model.layers)

    def test_vllm_language_model_interface_is_followed(self):
        """A model that names its language model (`get_language_model()`, vLLM's interface) is read there."""
        model = VLLMShaped()
        model.get_language_model = lambda: model.language_model
        assert len(decoder_layers(model)) == 5

    def test_every_user_shares_the_one_function(self):
        """The trainers, the perturb-layer fault and localize's capture all use this function."""
        from rlcheck.engines import vllm_perturb
        from rlcheck.trainers import backends

        assert vllm_perturb.decoder_layers is decoder_layers and backends.decoder_layers is decoder_layers

    @pytest.mark.parametrize("arch", ["llama", "mamba2", "hybrid"])
    def test_modelzoo_models(self, arch, tiny_model):
        """The tiny Llama, Mamba2 and hybrid give their decoder layers (Mamba2's under `backbone`)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model(arch))
        assert len(decoder_layers(model)) == model.config.num_hidden_layers

    def test_no_layer_list_is_refused_by_name(self):
        """A module with two unrelated `layers` lists and no embedding: a ConfigError naming them."""
        model = torch.nn.Module()
        model.a, model.b = _Stack(2, embed=False), _Stack(3, embed=False)
        with pytest.raises(ConfigError, match="a.layers, b.layers"):
            decoder_layers(model)
