"""A reproducer of a vLLM logprob divergence, judged by an independent Hugging Face Transformers
forward pass. `rlcheck repro` writes this file as repro.py, with CASE filled in; it imports vllm,
torch and transformers only (never rlcheck), so that it can be attached to an upstream bug report.

    python repro.py     # exit 1: vLLM's logprobs leave the reference's (it reproduces); 0: they agree

What it runs (CASE, also in inputs.json beside it):
1. `vllm.LLM(model, **CASE["engine"])`, with CASE["env"] set first (the engine in this process);
2. CASE["history"]: requests the engine serves first, which leave their state behind (not judged);
3. CASE["weight_update"], if any: every parameter moved by `scale` x its RMS (seeded noise), loaded
   with `reload_weights` as an RL trainer's weight sync does, then the prefix cache reset;
4. CASE["batch"]: the requests judged, submitted together in this order, greedy (temperature 0,
   EOS ignored), each token's logprob returned.
Each batch request's prompt + generated tokens then go through the model in Transformers (float32,
one sequence at a time, no cache, the same weight update): log_softmax of its logits at each
generated token is the expected logprob. A request fails when some token's |vLLM - reference|
exceeds CASE["threshold"]; the first such token is printed with both logprobs.

`RLCHECK_VLLM_FAULT`: a case found with one of rlcheck's injected engine faults (CASE["fault"])
reproduces only with that variable set and rlcheck installed, whose vLLM plugin injects the fault;
a healthy vLLM then agrees with the reference (exit 0).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

CASE: dict[str, Any] = {}  # rlcheck repro writes the case here
FAULT_ENV = "RLCHECK_VLLM_FAULT"
SHOWN = 5  # failing requests printed


def main(case: dict[str, Any] | None = None) -> int:
    """Run the case (CASE, else inputs.json beside this file); 1 when it reproduces, 0 when not."""
    case = case or CASE or json.loads((Path(__file__).resolve().parent / "inputs.json").read_text())
    model = model_dir(case)
    print(header(case, model), flush=True)
    outputs, _ = run_engine(case, model)
    reference = reference_logprobs(case, model, outputs)
    return verdict(case, outputs, reference)


def model_dir(case: dict[str, Any]) -> Path:
    """The model folder: $REPRO_MODEL, else CASE["model"] (relative to this file's folder)."""
    path = Path(os.environ.get("REPRO_MODEL") or case["model"])
    return path if path.is_absolute() else Path(__file__).resolve().parent / path


def header(case: dict[str, Any], model: Path) -> str:
    import torch
    import transformers
    import vllm

    fault, active = case.get("fault"), os.environ.get(FAULT_ENV)
    lines = [f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
             f"model {model}", f"engine: {case['engine']}",
             f"{len(case['history'])} history request(s), {len(case['batch'])} batch request(s)"
             + (", a weight update before the batch" if case.get("weight_update") else "")]
    if fault and active != fault:
        lines.append(f"note: this case was found with rlcheck's injected vLLM fault {fault!r}; it reproduces with "
                     f"{FAULT_ENV}={fault} and rlcheck installed (its vLLM plugin), a healthy vLLM should not")
    elif active:
        lines.append(f"{FAULT_ENV}={active}: rlcheck's vLLM plugin injects this fault into the engine")
    return "\n".join(lines)


# ---- vLLM -------------------------------------------------------------------------------------------


def run_engine(case: dict[str, Any], model: Path, before_batch: Any = None,
               after_batch: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The batch's outputs ({"token_ids", "logprobs"} per request, batch order) and how the engine
    ran ({"num_blocks", "block_size", ...}). `before_batch(llm)` and `after_batch(llm, outputs)`:
    called on the live engine (rlcheck's probes hook it there); the engine is released at the end."""
    llm = build_llm(case, model)
    try:
        if case["history"]:
            llm.generate(prompts(case["history"]), sampling(case["history"]), use_tqdm=False)
        if case.get("weight_update"):
            update = weight_update(model, **case["weight_update"])
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(update.items())})
            llm.reset_prefix_cache()  # what a trainer's sync must do: reload_weights keeps the cache
        if before_batch is not None:
            before_batch(llm)
        outs = llm.generate(prompts(case["batch"]), sampling(case["batch"]), use_tqdm=False)
        outputs = []
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            outputs.append({"request_id": str(out.request_id), "token_ids": ids,
                            "logprobs": [float(pos[t].logprob) for pos, t in zip(c.logprobs, ids, strict=True)]})
        if after_batch is not None:
            after_batch(llm, outputs)
        return outputs, engine_info(llm)
    finally:
        del llm
        gc.collect()


def build_llm(case: dict[str, Any], model: Path) -> Any:
    """`vllm.LLM(model, **CASE["engine"])`, CASE["env"] set first where unset. With kv_cache_memory_bytes
    set, VLLM_CPU_KVCACHE_SPACE is left out while the engine starts: vLLM's CPU backend would let the
    variable win."""
    unset = {k: str(v) for k, v in case.get("env", {}).items() if k not in os.environ}
    os.environ.update(unset)
    _drop_vllm_env_cache(unset or None)
    from vllm import LLM

    engine = dict(case["engine"])
    with _without_env("VLLM_CPU_KVCACHE_SPACE" if "kv_cache_memory_bytes" in engine else None):
        return LLM(model=str(model), **engine)


@contextlib.contextmanager
def _without_env(name: str | None):
    held = os.environ.pop(name, None) if name else None
    _drop_vllm_env_cache(held)
    try:
        yield
    finally:
        if held is not None:
            os.environ[name] = held
            _drop_vllm_env_cache(held)


def _drop_vllm_env_cache(changed: Any) -> None:
    if changed is None:
        return
    with contextlib.suppress(ImportError, AttributeError):
        import vllm.envs

        vllm.envs.disable_envs_cache()


def engine_info(llm: Any) -> dict[str, Any]:
    vc = llm.llm_engine.vllm_config
    return {"num_blocks": vc.cache_config.num_gpu_blocks, "block_size": vc.cache_config.block_size,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
            "enforce_eager": vc.model_config.enforce_eager, "dtype": str(vc.model_config.dtype).removeprefix("torch.")}


def prompts(requests: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in requests]


def sampling(requests: list[dict[str, Any]]) -> list[Any]:
    """Greedy, exactly max_tokens tokens each (EOS ignored), the sampled token's logprob."""
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True, logprobs=0,
                           detokenize=False) for r in requests]


@functools.lru_cache(maxsize=2)
def weight_update(model: Path, seed: int, scale: float) -> dict[str, Any]:
    """Every parameter of the model folder's weights plus scale x its RMS x N(0, 1) noise (one seeded
    generator, parameters in name order): new weights, as an RL trainer's update sends them (computed
    once per process; callers copy, never change them)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, p in sorted(hf.named_parameters()):
        w = p.detach()
        rms = w.pow(2).mean().sqrt().clamp_min(1e-8)
        out[name] = w + scale * rms * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    return out


# ---- the reference ----------------------------------------------------------------------------------


def reference_logprobs(case: dict[str, Any], model: Path, outputs: list[dict[str, Any]]) -> list[list[float]]:
    """Transformers' logprob of every generated token of the batch, one sequence at a time (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    if case.get("weight_update"):
        hf.load_state_dict(weight_update(model, **case["weight_update"]), strict=False)
    out = []
    with torch.no_grad():
        for request, o in zip(case["batch"], outputs, strict=True):
            prompt, gen = list(request["prompt_token_ids"]), o["token_ids"]
            ids = torch.tensor([prompt + gen], dtype=torch.long)
            logits = hf(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()  # (len(gen), V)
            logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(gen)[:, None])[:, 0]
            out.append([float(x) for x in logp])
    return out


# ---- the verdict ------------------------------------------------------------------------------------


def divergence(engine: list[float], reference: list[float], threshold: float) -> tuple[float, int | None]:
    """(max |engine - reference| (inf where either is not finite), the first position over threshold)."""
    worst, first = 0.0, None
    for i, (a, b) in enumerate(zip(engine, reference, strict=True)):
        d = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
        worst = max(worst, d)
        if first is None and d > threshold:
            first = i
    return worst, first


def verdict(case: dict[str, Any], outputs: list[dict[str, Any]], reference: list[list[float]]) -> int:
    """Print the failing requests' first divergent token and the verdict; 1 when it reproduces."""
    threshold = float(case["threshold"])
    scores = [divergence(o["logprobs"], ref, threshold) for o, ref in zip(outputs, reference, strict=True)]
    failing = [i for i, (worst, _) in enumerate(scores) if worst > threshold]
    for i in failing[:SHOWN]:
        o, (worst, at) = outputs[i], scores[i]
        print(f"batch request {i} ({len(case['batch'][i]['prompt_token_ids'])} prompt tokens, "
              f"{len(o['token_ids'])} generated): first divergent token at generated position {at}: "
              f"token id {o['token_ids'][at]}, vLLM logprob {o['logprobs'][at]:.6g}, Transformers logprob "
              f"{reference[i][at]:.6g} (|d| {abs(o['logprobs'][at] - reference[i][at]):.3g} > {threshold:g}; "
              f"max |d| over the request {worst:.3g})")
    worst = max((s for s, _ in scores), default=0.0)
    if failing:
        print(f"REPRODUCED: {len(failing)} of {len(outputs)} batch requests leave the Transformers reference "
              f"(max |d| {worst:.3g} nats > {threshold:g})")
        return 1
    print(f"NOT REPRODUCED: every batch request within {threshold:g} nats of the Transformers reference "
          f"(max |d| {worst:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
