"""The engine's side of the sync check (`rlcheck.core.sync_check`): a fingerprint, per decoder layer, of
the weights a vLLM model computes with, taken inside its worker.

    engine_fp = llm.apply_model(engine_fingerprint)[0]     # {"3:linear": (sum, sumsq, l1), ...}

Linear layers are probed with one-hot rows through their own forward (or, with a bias, their
`quant_method.apply` without it), so the numbers come from whatever the engine really multiplies with: on vLLM's CPU backend the weights of a linear
layer are handed to oneDNN (or packed) after loading and the parameter left empty; on GPUs it is the
parameter itself. Mamba conv layers (a linear class holding a 3-D weight) are read as parameters.
`add_stats` is shared with the trainer's side (`rlcheck.trainers.fingerprint`). Tensor parallelism
is refused (replicated tensors would be counted once per worker).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlcheck.core.sync_check import layer_key, probe_columns
from rlcheck.errors import UnsupportedVLLMError

DERIVED_BUFFERS = ("conv_weights",)
"""Buffers computed from the weights at load (Mamba mixers' conv weights), checked against their source."""


def add_stats(fp: dict[str, list[float]], key: str, t: torch.Tensor) -> None:
    """Add t's (sum, sum of squares, sum of |x|), in float64, to fp[key]."""
    t = t.detach().double()
    acc = fp.setdefault(key, [0.0, 0.0, 0.0])
    acc[0] += float(t.sum())
    acc[1] += float((t * t).sum())
    acc[2] += float(t.abs().sum())


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the engine computes in (its embeddings')."""
    return next(t.dtype for n, t in model.named_parameters() if "embed" in n)


def _probed_linear(module: Any) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase) and module.weight.dim() != 3  # 3-D: a Mamba conv, read as a parameter


def engine_fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """The fingerprint of a vLLM model (runs in its worker: `llm.apply_model(engine_fingerprint)`)."""
    dtype = model_dtype(model)
    fp: dict[str, list[float]] = {}
    probed = set()
    with torch.no_grad():
        for name, m in model.named_modules():
            key = layer_key(name + ".")
            if not key.isdigit() or not _probed_linear(m):
                continue
            if getattr(m, "tp_size", 1) != 1:
                raise UnsupportedVLLMError("the sync check fingerprints engines with tensor_parallel_size=1 only")
            cols = probe_columns(m.input_size)
            x = torch.zeros(len(cols), m.input_size, dtype=dtype, device=_device(m))
            x[torch.arange(len(cols)), torch.tensor(cols)] = 1
            add_stats(fp, key + ":linear", _linear_output(m, x).to(dtype))
            probed.add(name + ".weight")
        for name, p in model.named_parameters():
            if name not in probed:
                add_stats(fp, layer_key(name) + ":params", _rows(model, name, p).to(dtype))
        for name, b in model.named_buffers():
            if name.rpartition(".")[2] in DERIVED_BUFFERS:
                add_stats(fp, layer_key(name) + ":buffers", b.to(dtype))
    return fp


def _linear_output(m: Any, x: torch.Tensor) -> torch.Tensor:
    """x through the layer as the engine runs it: its forward (hooks included) when it has no bias,
    else its `quant_method` without the bias (a one-hot row plus a bias would not be exact)."""
    if getattr(m, "bias", None) is None:
        y = m(x)
        return y[0] if isinstance(y, tuple) else y
    return m.quant_method.apply(m, x, bias=None)


def _device(module: Any) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _rows(model: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor:
    """An embedding or LM head without vLLM's vocabulary padding rows (the checkpoint has none)."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    vocab = getattr(owner, "org_vocab_size", None)
    return p[:vocab] if vocab is not None and p.dim() == 2 and p.size(0) > vocab else p


def fingerprint_llm(llm: Any):
    """The fingerprint of the weights a `vllm.LLM` computes with (every worker's part, added up)."""
    from rlcheck.core.sync_check import merge_fingerprints

    return merge_fingerprints(llm.apply_model(engine_fingerprint))


def score_tokens(llm: Any, prompts: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
    """The engine's logprob of each response token after its prompt, teacher-forced: a fresh prefill of
    prompt + response (the prefix cache not read), vLLM's prompt logprobs, which are log_softmax of the
    unscaled logits (temperature 1, no logit processor) whatever the sampling settings."""
    from vllm import SamplingParams

    rows = [{"prompt_token_ids": list(map(int, p)) + list(map(int, r))} for p, r in zip(prompts, responses, strict=True)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, skip_reading_prefix_cache=True,
                            detokenize=False)
    outs = llm.generate(rows, params, use_tqdm=False)
    scored = []
    for out, p, r in zip(outs, prompts, responses, strict=True):
        ids = list(p) + list(r)
        scored.append(np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(len(p), len(ids))], dtype=np.float32))
    return scored
