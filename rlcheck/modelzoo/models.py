"""Hugging Face configs of the tiny models, one function per architecture, and their random init;
and (re-exported from `rlcheck.core.model_types`) which model types carry recurrent (state-space) layers,
`is_recurrent`."""

from __future__ import annotations

import math

from rlcheck.core.model_types import RECURRENT_MODEL_TYPES, is_recurrent  # noqa: F401 - re-exported here

HIDDEN = 128
HEAD_DIM = 64  # the vLLM CPU attention kernels support head sizes 32..256 (16 fails)
INTERMEDIATE = 256
MAMBA_HEADS = 4  # expand 2 * HIDDEN / MAMBA_HEADS = 64 per head
MAMBA_STATE = 16
MAMBA_CHUNK = 64
MAX_POSITIONS = 1024
MOE_EXPERTS = 8
MOE_TOP_K = 2
MOE_INTERMEDIATE = 128
ARCHS = ("llama", "mamba2", "hybrid", "moe")
DEFAULT_LAYERS = {"llama": 4, "mamba2": 4, "hybrid": 4, "moe": 2}
"""Decoder layers when the spec does not say: the moe's 2 layers already hold 16 experts."""


def llama_config(max_positions: int = MAX_POSITIONS, **common):
    from transformers import LlamaConfig

    return LlamaConfig(
        intermediate_size=INTERMEDIATE,
        num_attention_heads=HIDDEN // HEAD_DIM,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        **common,
    )


def mamba2_config(max_positions: int = MAX_POSITIONS, **common):
    from transformers import Mamba2Config

    del max_positions  # a pure SSM has no position limit
    return Mamba2Config(
        num_heads=MAMBA_HEADS,
        head_dim=2 * HIDDEN // MAMBA_HEADS,
        expand=2,
        n_groups=1,
        state_size=MAMBA_STATE,
        chunk_size=MAMBA_CHUNK,
        **common,
    )


def hybrid_layer_types(num_layers: int) -> list[str]:
    """Mamba2 layers around one attention layer, as in Jamba / Granite 4 hybrids."""
    return ["full_attention" if i == num_layers // 2 else "linear_attention" for i in range(num_layers)]


def hybrid_config(max_positions: int = MAX_POSITIONS, **common):
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        intermediate_size=INTERMEDIATE,
        shared_intermediate_size=INTERMEDIATE,
        num_local_experts=0,  # dense: the shared MLP only
        layer_types=hybrid_layer_types(common["num_hidden_layers"]),
        num_attention_heads=HIDDEN // HEAD_DIM,
        num_key_value_heads=1,
        attention_multiplier=1.0 / math.sqrt(HEAD_DIM),  # the default 1.0 is no softmax scaling
        position_embedding_type="rope",
        max_position_embeddings=max_positions,
        mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=2 * HIDDEN // MAMBA_HEADS,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_d_state=MAMBA_STATE,
        mamba_chunk_size=MAMBA_CHUNK,
        **common,
    )


def moe_config(max_positions: int = MAX_POSITIONS, **common):
    """Qwen3-MoE shape: every layer's MLP is `MOE_EXPERTS` experts, `MOE_TOP_K` picked per token by a
    linear router, so a tiny numeric difference on a near-tie token changes which experts run."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        num_attention_heads=HIDDEN // HEAD_DIM,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        **common,
    )


HF_CONFIGS = {"llama": llama_config, "mamba2": mamba2_config, "hybrid": hybrid_config, "moe": moe_config}


def hf_config(arch: str, vocab_size: int, num_layers: int, special_ids: dict, max_positions: int = MAX_POSITIONS):
    """The Hugging Face config of `arch`; `special_ids`: bos/eos/pad token ids; `max_positions`: the
    context length vLLM allows (`max_model_len` up to it)."""
    return HF_CONFIGS[arch](
        max_positions=max_positions,
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        **special_ids,
    )


def init_model(config, seed: int, logit_std: float):
    """A float32 model with Hugging Face's random init under `seed`, then an output head of std
    `logit_std / sqrt(hidden)`: the final norm leaves hidden states of RMS ~1, so the initial logits
    have std ~`logit_std` and the next-token distribution is far from flat."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # seed locally, leave the caller's RNG alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, logit_std / math.sqrt(config.hidden_size))
    return model.eval()
