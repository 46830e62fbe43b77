"""The loop's preflight (`rlcheck.preflight`): the static checks of a `LoopConfig`, before any actor starts.

    findings = check_loop(cfg)        # GRPOLoop.__init__: one warning block; critical findings refused
    cfg.context()["preflight"]        # the same findings, in every dump's meta.json

The engine side is `cfg.rollout` as the engine will run it (rlcheck's `VLLMEngine`: its dtype, logprobs mode,
temperature, any logit processing in `sampling`, vLLM's `hf_overrides` in `engine_kwargs`; greedy decoding
reports logprobs at T = 1; `sync_weights` resets the prefix cache after every sync), the trainer side
`cfg.trainer` (its model folder, dtype and temperature: it scores log_softmax(logits / T) over the whole
vocabulary); both with an injected fault's settings (`Fault.rollout_config`, `trainer_config`: a RoPE base
set through hf_overrides is what the engine runs, and what the preflight must see). An engine on a GPU that runs eager
(`VLLMConfig.enforce_eager`, True by default) is said, as an info finding: it runs no CUDA graphs.
"""

from __future__ import annotations

from typing import Any

from rlcheck.preflight import Finding, PreflightConfig, attach_check

WHERE = "rlcheck's loop, before its actors start"


def _number(sampling: dict[str, Any], key: str, neutral: float) -> float:
    value = sampling.get(key)
    return neutral if value is None else float(value)


def loop_preflight_config(cfg: Any) -> PreflightConfig:
    """The two sides' settings of a `LoopConfig` (module docstring)."""
    r, t = cfg.fault.rollout_config(cfg.rollout), cfg.fault.trainer_config(cfg.trainer)
    s = dict(r.sampling)
    return PreflightConfig(
        model=t.model, engine_model=r.model, engine_overrides=r.engine_kwargs.get("hf_overrides"), temperature=1.0 if r.greedy else r.temperature,
        top_p=_number(s, "top_p", 1.0), top_k=int(_number(s, "top_k", 0)), min_p=_number(s, "min_p", 0.0),
        repetition_penalty=_number(s, "repetition_penalty", 1.0), logprobs_mode=r.logprobs_mode, dtype=r.dtype,
        trainer_dtype=t.dtype, trainer_temperature=t.temperature,
        prefix_caching=bool(r.engine_kwargs.get("enable_prefix_caching", True)), resets_prefix_cache=True,
        enforce_eager=r.enforce_eager if cfg.placement.rollout_gpus > 0 else None)  # CUDA graphs: a GPU's


def check_loop(cfg: Any) -> tuple[Finding, ...]:
    """The attach-time check (`rlcheck.preflight.attach_check`): a warning block, critical findings refused."""
    return attach_check(loop_preflight_config(cfg), where=WHERE)


def loop_findings(cfg: Any) -> list[dict[str, Any]]:
    """The findings as the run's context records them (no warning: `check_loop` gave it)."""
    from rlcheck.preflight import run_static

    return [f.to_dict() for f in run_static(loop_preflight_config(cfg)).findings]
