"""The TRL integration's options, and what it checks of a trainer before attaching to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck import metrics as K
from rlcheck.errors import ConfigError
from rlcheck.faults import Fault, parse_inject
from rlcheck.integrations._trl_batch import FORWARD_PREFIXES
from rlcheck.integrations._trl_sync import METHODS

TRAINER_METRICS = (K.ABS_DIFF_MEAN, K.ABS_DIFF_MAX, K.KL_K3, K.RATIO_ESS, K.ALARM_COUNT)
@dataclass(frozen=True)
class TRLOptions:
    """How rlcheck sits inside a GRPOTrainer."""

    vllm_sync: str = "auto"
    """"auto": in colocate mode, vLLM's `reload_weights` when TRL's own sync cannot load into this
    vLLM (0.32), TRL's otherwise; "reload" or "trl" to force one."""
    inject: str | Fault | None = None
    """A fault for a fire drill, as `rlcheck demo --inject` takes it ("stale-weights@3",
    "skip-sync-every=4", "corrupt-seqs=0.05@2", ...): sync faults skip TRL's real vLLM weight sync,
    data faults corrupt what the Monitor sees (training is untouched)."""
    trainer_metrics: tuple[str, ...] = TRAINER_METRICS
    """rlcheck metrics appended to TRL's logged metrics every step (rank 0)."""
    forward_prefixes: tuple[str, ...] = FORWARD_PREFIXES
    """TRL step metrics logged beside rlcheck's, as `trl/<name>`."""

    def __post_init__(self) -> None:
        if self.vllm_sync not in METHODS:
            raise ConfigError(f"vllm_sync must be one of {METHODS}, got {self.vllm_sync!r}")
        if isinstance(self.trainer_metrics, str) or isinstance(self.forward_prefixes, str):
            raise ConfigError("trainer_metrics and forward_prefixes are tuples of strings")


def check_fault(inject: str | Fault | None) -> Fault:
    """The fault `inject` names, if the TRL integration can inject it (ConfigError otherwise)."""
    fault = inject if isinstance(inject, Fault) else parse_inject(inject)
    if fault.engine_fault() is not None or type(fault).trainer_config is not Fault.trainer_config:
        raise ConfigError(
            f"fault {fault.describe()!r} acts inside the rollout engine or changes the trainer's config; "
            "with TRL, rlcheck injects sync faults (skip-sync-every, stale-weights) and data faults only"
        )
    return fault


def check_trainer(trainer: Any) -> None:
    """ConfigError when rlcheck cannot watch this GRPOTrainer as configured."""
    if not getattr(trainer, "use_vllm", False):
        raise ConfigError(
            "rlcheck compares vLLM's sampling logprobs with the trainer's: set GRPOConfig(use_vllm=True)"
        )
    args = trainer.args
    if args.steps_per_generation * trainer.num_iterations < args.gradient_accumulation_steps:
        raise ConfigError(
            f"this GRPOConfig generates several times per optimizer step (steps_per_generation="
            f"{args.steps_per_generation} x num_iterations={trainer.num_iterations} < gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}); rlcheck numbers its steps by optimizer step: make "
            "steps_per_generation a multiple of gradient_accumulation_steps (TRL's default)"
        )
    if getattr(trainer, "rlcheck", None) is not None:
        raise ConfigError("this trainer already has an rlcheck monitor attached")


def trl_context(trainer: Any) -> dict[str, Any]:
    """What decides the two sides' numerics, for every dump's meta.json: sampling settings, the
    trainer's precision and vLLM's dtype (TRL leaves it "auto": bf16 for a float32 checkpoint)."""
    args = trainer.args
    ctx: dict[str, Any] = {
        "framework": "trl",
        "model": getattr(trainer.model.config, "_name_or_path", None),
        "vllm_mode": args.vllm_mode,
        "temperature": trainer.temperature,
        "top_p": trainer.top_p,
        "top_k": trainer.top_k,
        "min_p": trainer.min_p,
        "repetition_penalty": trainer.repetition_penalty,
        "trainer_bf16": bool(args.bf16),
        "trainer_fp16": bool(args.fp16),
        "cast_lm_head_to_fp32": bool(getattr(args, "cast_lm_head_to_fp32", False)),
        "importance_sampling": args.vllm_importance_sampling_mode if trainer.vllm_importance_sampling_correction
        else None,
    }
    llm = getattr(trainer.vllm_generation, "llm", None)
    if llm is not None:
        ctx["vllm_dtype"] = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return ctx
