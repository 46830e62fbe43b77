"""What a verl run's dumps record of its rollout engine (`rlcheck.core.run.context`), read from verl's
trainer config (`actor_rollout_ref.rollout`), as verl 0.9 hands it to vLLM:

    context = verl_context(config)   # MonitorConfig(context={**context, ...}); the verl plugin's Session does it

`temperature` (0 with `do_sample=False`: greedy), `logprobs_mode`, `top_p` / `top_k` (verl's neutral
values: 1.0 and -1 or 0), `response_length` and `n`; `dtype` as configured (verl's workers start vLLM in
their own processes: the dtype they ran is not asked here), `tensor_model_parallel_size`, `enforce_eager`,
`max_num_seqs`. verl sizes vLLM's cache by `gpu_memory_utilization`: no cache budget is recorded.
"""

from __future__ import annotations

from typing import Any

from rlcheck.core.model_types import experts_at, model_type_at
from rlcheck.core.run.context import Engine, Sampling, record
from rlcheck.integrations.verl.preflight_checks import get

ROLLOUT = "actor_rollout_ref.rollout"


def verl_context(config: Any) -> dict[str, Any]:
    """The context of a verl run's dumps: framework, model, and the engine's sampling and settings."""
    r = lambda key, default=None: get(config, f"{ROLLOUT}.{key}", default)  # noqa: E731
    greedy = not bool(r("do_sample", True))
    top_p, top_k = float(r("top_p", 1.0)), int(r("top_k", -1))
    processing = {**({"top_p": top_p} if top_p < 1.0 else {}), **({"top_k": top_k} if top_k > 0 else {})}
    sampling = Sampling(temperature=0.0 if greedy else float(r("temperature", 1.0)), greedy=greedy,
                        logprobs_mode=str(r("logprobs_mode", "processed_logprobs")), processing=processing,
                        max_tokens=_int(r("response_length")), n=_int(r("n")))
    engine = Engine(name=str(r("name", "vllm")), configured_dtype=str(r("dtype", "bfloat16")),
                    enforce_eager=bool(r("enforce_eager", False)),
                    tensor_parallel_size=_int(r("tensor_model_parallel_size")), max_num_seqs=_int(r("max_num_seqs")))
    model = _str(get(config, "actor_rollout_ref.model.path"))
    return {"framework": "verl", "model": model, "model_type": model_type_at(model) if model else None,
            "experts": experts_at(model) if model else None, **record(sampling, engine)}


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _str(value: Any) -> str | None:
    return None if value is None else str(value)
