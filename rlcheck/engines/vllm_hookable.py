"""How a vLLM engine that rlcheck hooks is built: the engine guard, the engine faults
(`rlcheck.engines.vllm_faults`) and the layer hooks of `rlcheck localize` read vLLM's V1 model runner
step by step, which CUDA graphs, async scheduling and vLLM 0.32's V2 runner bypass."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from rlcheck.errors import UnsupportedVLLMError
from rlcheck.versions import require_vllm

HOOKABLE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""On CUDA vLLM 0.32 runs its V2 model runner (v1/worker/gpu/model_runner.py, full CUDA graphs) unless
this says no (`VllmConfig.use_v2_model_runner`, config/vllm.py:703); it has none of the V1 methods
hooked here. The CPU backend has no Triton, so it runs V1 anyway."""


def hookable_settings(kwargs: Mapping[str, Any], environ: Mapping[str, str]):
    """What an engine the guard or an engine fault will hook needs: `vllm.LLM` kwargs with
    enforce_eager (full CUDA graphs replay their captured slot indices, a compiled forward need not
    call module hooks), synchronous scheduling (the hooks were validated with it; vLLM turns async
    scheduling on by default on CUDA, the CPU build forces it off) and the V1 model runner. Returns
    (kwargs, environment variables to set, a line naming what changed and why, or None)."""
    env = {k: v for k, v in HOOKABLE_ENV.items() if environ.get(k) != v}
    changed = (([] if kwargs.get("enforce_eager") else ["enforce_eager=True"])
               + ([] if kwargs.get("async_scheduling") is False else ["async_scheduling=False"])
               + [f"{k}={v}" for k, v in env.items()])
    note = None if not changed else (
        f"rlcheck: vLLM engine built with {', '.join(changed)}: the engine guard and engine faults hook "
        "the V1 model runner's eager forward, step by step, which CUDA graphs, async scheduling and the V2 "
        "runner (vLLM 0.32's CUDA default) bypass")
    return {**kwargs, "enforce_eager": True, "async_scheduling": False}, env, note


def hookable_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`hookable_settings` applied to this process: the variables set (vLLM's cache of them dropped, as a
    previous in-process engine fills it), the line printed to stderr; returns the kwargs. Refused
    (UnsupportedVLLMError) before the engine starts on a vLLM the hooks were not written for."""
    require_vllm("a hookable engine (the engine guard, engine faults, RLCHECK_BREAK_ON, layer hooks)")
    if int(kwargs.get("tensor_parallel_size") or 1) > 1:
        raise UnsupportedVLLMError(
            f"a hookable engine (the engine guard, engine faults, RLCHECK_BREAK_ON, layer hooks) runs one worker "
            f"in this process; tensor_parallel_size={kwargs['tensor_parallel_size']} puts its workers in others: "
            "use tensor_parallel_size=1 for these tools")
    out, env, note = hookable_settings(kwargs, os.environ)
    if env:
        import vllm.envs

        os.environ.update(env)
        vllm.envs.disable_envs_cache()
    if note:
        print(note, file=sys.stderr)
    return out
