"""Environment variables a `VLLMEngine` sets before vLLM starts (vLLM's worker processes inherit them),
and the engine itself (`build_llm`).

- `VLLM_ENABLE_V1_MULTIPROCESSING=0` (unless set): the engine core in this process.
- `VLLM_ALLOW_INSECURE_SERIALIZATION=1` with tensor parallelism: rlcheck's functions (the sync check's
  fingerprint) go pickled to the worker processes.
- `TRITON_F32_DEFAULT=ieee` for a float32 engine on CUDA (unless set): there vLLM's attention runs on its
  Triton backend, whose `tl.dot` computes float32 in TF32 by default (about 1e-3 relative), which
  would put decode and prefill, and the engine and an fp32 HF reference, 1e-3 to 1e-2 nats apart
  against a 1e-3 fp32 threshold. Said in one stderr line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from contextlib import contextmanager
from typing import Any

from rlcheck.errors import InputError
from rlcheck.versions import check_tested

FP32 = ("float32", "fp32", "float")
LOGIT_PROCESSING = frozenset({"top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty", "logit_bias", "bad_words", "allowed_token_ids"})
"""`vllm.SamplingParams` fields that change the distribution a token is drawn from (and its processed logprob)."""


def engine_env(dtype: str, tensor_parallel_size: int, cuda: bool | None = None,
               environ: MutableMapping[str, str] = os.environ) -> None:
    """Set what an engine of `dtype` on `tensor_parallel_size` workers needs (`cuda` None: ask torch)."""
    environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if tensor_parallel_size > 1:
        environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if str(dtype) in FP32 and "TRITON_F32_DEFAULT" not in environ and (cuda if cuda is not None else _cuda()):
        environ["TRITON_F32_DEFAULT"] = "ieee"
        print("rlcheck: TRITON_F32_DEFAULT=ieee for a float32 vLLM engine on CUDA (Triton's tl.dot would "
              "compute float32 in TF32)", file=sys.stderr)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def effective_settings(llm: Any) -> dict[str, Any]:
    """How a started `vllm.LLM` runs, as vLLM resolved it (a dump of a failure must say so): dtype,
    eager or graphs, async scheduling, the cache (bytes asked for, blocks, block size), and in this
    process the model runner's class and the attention backends."""
    vc = llm.llm_engine.vllm_config
    out: dict[str, Any] = {
        "dtype": str(vc.model_config.dtype).removeprefix("torch."), "enforce_eager": bool(vc.model_config.enforce_eager),
        "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
        "async_scheduling": bool(vc.scheduler_config.async_scheduling),
        "kv_cache_memory_bytes": getattr(vc.cache_config, "kv_cache_memory_bytes", None),
        "num_blocks": vc.cache_config.num_gpu_blocks, "block_size": vc.cache_config.block_size,
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "model_runner": "in another process", "attention_backends": [],
    }
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    worker = getattr(getattr(core, "model_executor", None), "driver_worker", None)
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if runner is not None:
        out["model_runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
        groups = [g for gs in (getattr(runner, "attn_groups", None) or []) for g in gs]
        out["attention_backends"] = sorted({getattr(g.backend, "__name__", str(g.backend)) for g in groups})
    return out


def vllm_record(cfg: Any, n: int | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a dump records of an engine of `VLLMConfig` `cfg` (`rlcheck.core.run.context`: "sampling" and
    "engine", with "schema"); `settings`: `effective_settings` of the started engine (the dtype it ran)."""
    from rlcheck.core.run.context import Engine, Sampling, record

    settings = settings or {}
    sampling = Sampling(temperature=0.0 if cfg.greedy else float(cfg.temperature), greedy=bool(cfg.greedy),
                        logprobs_mode=cfg.logprobs_mode, max_tokens=cfg.max_tokens, n=n,
                        processing={k: v for k, v in cfg.sampling.items() if k in LOGIT_PROCESSING})
    engine = Engine(name="vllm", dtype=settings.get("dtype"), configured_dtype=str(cfg.dtype),
                    enforce_eager=settings.get("enforce_eager", cfg.enforce_eager),
                    tensor_parallel_size=cfg.tensor_parallel_size, kv_cache_bytes=cfg.kv_cache_bytes,
                    max_num_seqs=cfg.max_num_seqs, engine_id=cfg.engine_id)
    return record(sampling, engine)


def build_llm(cfg: Any):
    """The `vllm.LLM` of a `VLLMConfig`: this process's environment set first (`engine_env`), a warning
    once when the installed vLLM is outside the tested range (`rlcheck.versions`), the
    config's settings, hookable ones where hooks will be used, vLLM's routed experts where the MoE
    routing is read from it (`rlcheck.engines.moe_capture.routing_plan`)."""
    engine_env(cfg.dtype, cfg.tensor_parallel_size)  # in-process core; TP pickling; fp32 Triton on CUDA
    if not os.path.isdir(cfg.model):
        raise InputError(f"model {cfg.model!r} is not a local directory (build one with `rlcheck make-model`)")
    check_tested("vllm", what="rlcheck's vLLM engine (it reads vLLM's outputs, and its model runner when hooked)")
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "max_model_len": cfg.max_model_len,
        "enforce_eager": cfg.enforce_eager,
        "logprobs_mode": cfg.logprobs_mode,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "max_logprobs": max(cfg.top_logprobs, 20),
    }
    optional = {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "kv_cache_memory_bytes": cfg.kv_cache_bytes, "gpu_memory_utilization": cfg.gpu_memory_utilization,
                "block_size": cfg.block_size}
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(cfg.engine_kwargs)
    if cfg.hookable or cfg.guard is not None or os.environ.get("RLCHECK_BREAK_ON"):
        from rlcheck.engines.vllm_faults import hookable_kwargs

        kwargs = hookable_kwargs(kwargs)
    from rlcheck.engines.moe_capture import routing_plan

    if routing_plan(cfg) == "vllm":
        kwargs["enable_return_routed_experts"] = True
    with _cache_size_asked("kv_cache_memory_bytes" in kwargs):
        return LLM(**kwargs)


@contextmanager
def _cache_size_asked(asked: bool, environ: MutableMapping[str, str] = os.environ):
    """With a cache size in the config, `VLLM_CPU_KVCACHE_SPACE` left out while the engine starts: vLLM's
    CPU backend lets the variable win over `kv_cache_memory_bytes`, so a set variable would silently undo
    `kv_cache_bytes` (and `rlcheck stress --kv-cache`, its sweeps' memory lever). Said in one stderr line."""
    held = environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if asked else None
    if held is not None:
        print(f"rlcheck: VLLM_CPU_KVCACHE_SPACE={held} left out while this engine starts: its kv_cache_bytes "
              "sets the cache (vLLM's CPU backend would let the variable win)", file=sys.stderr)
        _drop_vllm_env_cache()
    try:
        yield
    finally:
        if held is not None:
            environ["VLLM_CPU_KVCACHE_SPACE"] = held
            _drop_vllm_env_cache()


def _drop_vllm_env_cache() -> None:
    try:
        import vllm.envs

        vllm.envs.disable_envs_cache()
    except (ImportError, AttributeError):  # another vLLM: nothing cached
        pass
