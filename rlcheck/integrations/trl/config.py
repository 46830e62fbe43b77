"""The TRL integration's options, and what it checks of a trainer before attaching to it.

Sampling settings: TRL asks vLLM for `logprobs_mode="processed_logprobs"`, the logprobs of the
distribution each token was sampled from, after temperature and after any top-p / top-k / min-p
filter (renormalised) or repetition penalty; the trainer scores `log_softmax(logits / T)`. With
any of those set, every step shows a mismatch that is the sampler's, not a bug (a token inside
top_p=0.9 gains -log(0.9) ~ 0.1 nats at least), so attaching refuses them (`ConfigError` naming each
GRPOConfig field, `generation_kwargs` entries included), as rlcheck's own `VLLMConfig` does, unless
`TRLOptions(allow_logit_processing=True)`: then a warning, and the settings go into the context
every dump's meta.json carries (`logit_processing`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.errors import ConfigError
from rlcheck.faults import Fault, parse_inject
from rlcheck.integrations.trl.batch import FORWARD_PREFIXES
from rlcheck.integrations.trl.sync import METHODS
from rlcheck.preflight import as_context
from rlcheck.versions import check_tested

TRAINER_METRICS = (K.ABS_DIFF_MEAN, K.ABS_DIFF_MAX, K.KL_K3, K.RATIO_ESS, K.ALARM_COUNT)
DROPPED_SEQUENCES = "rlcheck/trl/dropped_sequences"
"""Quarantined sequences whose completion_mask rlcheck zeroed this step (all processes)."""
DROPPED_TOKENS = "rlcheck/trl/dropped_tokens"
"""Their loss tokens (completion_mask x tool_mask), taken out of TRL's `num_items_in_batch` too."""
SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty")
"""GRPOConfig fields that change the distribution vLLM samples from (and reports logprobs of)."""
SAMPLING_KWARGS = SAMPLING_FIELDS + ("presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
                                     "allowed_token_ids")
"""The same, as `vllm.SamplingParams` keys that `GRPOConfig.generation_kwargs` may set (they win)."""
_NEUTRAL = {"top_p": (1,), "top_k": (0, -1), "min_p": (0,), "repetition_penalty": (1,),
            "presence_penalty": (0,), "frequency_penalty": (0,)}  # None, and empty containers, too


@dataclass(frozen=True)
class TRLOptions:
    """How rlcheck sits inside a GRPOTrainer."""

    vllm_sync: str = "auto"
    """"auto": in colocate mode, vLLM's `reload_weights` when TRL's own sync cannot load into this
    vLLM (0.32), TRL's otherwise; "reload" or "trl" to force one."""
    sync_check: bool = True
    """In colocate mode, after a sync: the engine's per-layer fingerprint against that of the weights
    TRL streams, fingerprinted as they stream (`rlcheck.core.sync_check`); a mismatch is a critical
    `weights` alarm at the next step."""
    sync_check_budget: float | None = 0.02
    """The sync check's share of the run's wall time: the first three syncs are checked, each later one when
    the checks so far plus one more stay within this share of the time since the first (a sync that
    keeps failing is caught within a few steps); None: every sync."""
    inject: str | Fault | None = None
    """A fault for a fire drill, as `rlcheck demo --inject` takes it ("stale-weights@3",
    "skip-sync-every=4", "corrupt-seqs=0.05@2", ...): sync faults skip TRL's real vLLM weight sync,
    data faults corrupt what the Monitor sees (training is untouched)."""
    trainer_metrics: tuple[str, ...] = TRAINER_METRICS
    """rlcheck metrics appended to TRL's logged metrics every step (rank 0)."""
    forward_prefixes: tuple[str, ...] = FORWARD_PREFIXES
    """TRL step metrics logged beside rlcheck's, as `trl/<name>`."""
    allow_logit_processing: bool = False
    """Attach even when GRPOConfig sets top_p < 1, top_k > 0, min_p > 0 or repetition_penalty != 1
    (or `generation_kwargs` a filter or penalty): a warning instead of a ConfigError, and the settings
    recorded in the Monitor's context. The mismatch they cause is then real and counted."""
    mask_quarantined: bool = True
    """With the Monitor's quarantine on (`MonitorConfig.quarantine`): the quarantined sequences leave
    TRL's loss (their `completion_mask` rows zeroed, TRL's loss run on the kept rows alone: the loss of
    the batch without them, for every loss_type; `rlcheck.integrations.trl.loss`). False: the Monitor
    judges the step without them, but TRL still trains on them (a dry run of quarantine)."""
    top_logprobs: int | None = None
    """Top-k distribution metrics (`rlcheck/dist/*`, `rlcheck.integrations.trl.topk`): TRL's vLLM returns
    K logprobs per completion position and the trainer scores the same ids in one more no-grad forward
    per generation. None: K = 20 when the Monitor's `StatsConfig(distribution=True)`, off otherwise;
    0: off; K > 0: on (a MonitorConfig rlcheck opens gets distribution=True)."""

    measure_floor: bool = True
    """Where vLLM computes in a dtype coarser than the trainer's (bf16 under a float32 GRPOTrainer): score each
    generation's completions once more with a copy of the policy in vLLM's dtype, the step judged at that
    measured noise where it is above the precision's level (`rlcheck.integrations.trl.floor`: one more
    no-grad forward a generation, and the copy's memory). False: the precision's level only."""

    def __post_init__(self) -> None:
        if self.vllm_sync not in METHODS:
            raise ConfigError(f"vllm_sync must be one of {METHODS}, got {self.vllm_sync!r}")
        b = self.sync_check_budget
        if b is not None and not 0 < b <= 1:
            raise ConfigError(f"sync_check_budget must be None or in (0, 1], got {b!r}")
        k = self.top_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConfigError(f"top_logprobs must be None or an integer >= 0, got {k!r}")
        if isinstance(self.trainer_metrics, str) or isinstance(self.forward_prefixes, str):
            raise ConfigError("trainer_metrics and forward_prefixes are tuples of strings")


def check_fault(inject: str | Fault | None) -> Fault:
    """The fault `inject` names, if the TRL integration can inject it (ConfigError otherwise)."""
    fault = inject if isinstance(inject, Fault) else parse_inject(inject)
    hooks = ("trainer_config", "prompts", "trainer_inputs")  # the loop's own hooks, which TRL has no place for
    if fault.engine_fault() is not None or any(getattr(type(fault), h) is not getattr(Fault, h) for h in hooks):
        raise ConfigError(
            f"fault {fault.describe()!r} acts inside the rollout engine or changes the trainer's config; "
            "with TRL, rlcheck injects sync faults (skip-sync-every, stale-weights, drop-sync, permute-sync) and data "
            "faults only"
        )
    return fault


def check_config(args: Any) -> None:
    """ConfigError when rlcheck cannot watch a GRPOTrainer built with this GRPOConfig: what needs only
    the config, so that `RLCheckGRPOTrainer` refuses it before TRL loads the model and starts vLLM."""
    if not getattr(args, "use_vllm", False):
        raise ConfigError(
            "rlcheck compares vLLM's sampling logprobs with the trainer's: set GRPOConfig(use_vllm=True)"
        )
    spg, iterations, accumulation = args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps
    if spg is not None and spg * iterations < accumulation:
        raise ConfigError(
            f"this GRPOConfig generates several times per optimizer step (steps_per_generation="
            f"{spg} x num_iterations={iterations} < gradient_accumulation_steps={accumulation}); rlcheck "
            "numbers its steps by optimizer step: make steps_per_generation a multiple of "
            "gradient_accumulation_steps (TRL's default)"
        )


def check_versions() -> None:
    """Warn once when TRL or vLLM is outside the versions this adapter is tested on (before vLLM starts)."""
    check_tested("trl", what="the TRL adapter (it reads GRPOTrainer's internals)")
    check_tested("vllm", what="the TRL adapter's weight-sync check")


def check_trainer(trainer: Any) -> None:
    """ConfigError when rlcheck cannot watch this GRPOTrainer as configured."""
    check_config(trainer.args)
    if getattr(trainer, "rlcheck", None) is not None:
        raise ConfigError("this trainer already has an rlcheck monitor attached")


def trainer_dtype(args: Any, model: Any) -> str | None:
    """The dtype the trainer computes its logprobs in (module docstring); None: the model config's."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    dtype = getattr(model, "dtype", None) if not isinstance(model, str) else None
    if dtype is None:
        dtype = (getattr(args, "model_init_kwargs", None) or {}).get("dtype") if isinstance(
            getattr(args, "model_init_kwargs", None), dict) else None
    return None if dtype in (None, "auto") else str(dtype).removeprefix("torch.")


def trl_context(trainer: Any) -> dict[str, Any]:
    """What decides the two sides' numerics, for every dump's meta.json: the engine's sampling and
    precision in the dump schema (`rlcheck.core.run.context`: vLLM's dtype as its LLM runs it; TRL leaves
    it "auto", bf16 for a float32 checkpoint), the trainer's precision and the preflight's findings."""
    from rlcheck.core.model_types import experts_of
    from rlcheck.core.run.context import Engine, Sampling, record

    args = trainer.args
    processing = logit_processing(args)
    llm = getattr(trainer.vllm_generation, "llm", None)  # colocate: the engine in this process
    ran = None if llm is None else str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    # colocate builds its LLM with processed logprobs; a server's mode is the server's (not asked here)
    mode = "processed_logprobs" if args.vllm_mode == "colocate" else None
    sampling = Sampling(temperature=float(trainer.temperature), logprobs_mode=mode, processing=processing,
                        max_tokens=getattr(args, "max_completion_length", None), n=getattr(args, "num_generations", None))
    engine = Engine(name="vllm", dtype=ran, configured_dtype="auto",
                    tensor_parallel_size=getattr(args, "vllm_tensor_parallel_size", None))
    return {
        "framework": "trl",
        "model": getattr(trainer.model.config, "_name_or_path", None),
        "model_type": getattr(trainer.model.config, "model_type", None),
        "experts": experts_of(trainer.model.config),  # with model_type: a dense model with state (`core.model_types`)
        **record(sampling, engine),
        "vllm_mode": args.vllm_mode,
        "logit_processing": processing,
        "trainer_bf16": bool(args.bf16),
        "trainer_dtype": trainer_dtype(args, trainer.model),  # with vllm_dtype: the run's floor (`core.floors`)
        "trainer_fp16": bool(args.fp16),
        "cast_lm_head_to_fp32": bool(getattr(args, "cast_lm_head_to_fp32", False)),
        "importance_sampling": args.vllm_importance_sampling_mode if trainer.vllm_importance_sampling_correction
        else None,
        "preflight": as_context(getattr(trainer, "rlcheck_preflight", None)),  # `preflight_checks`' findings
    }


def _is_neutral(key: str, value: Any) -> bool:
    if value is None:
        return True
    if key in _NEUTRAL:
        return value in _NEUTRAL[key]
    return not value  # logit_bias, bad_words, allowed_token_ids: empty


def _generation_kwargs(args: Any) -> dict[str, Any]:
    kwargs = getattr(args, "generation_kwargs", None) or {}
    if isinstance(kwargs, str):  # GRPOConfig takes a JSON string from the command line
        kwargs = json.loads(kwargs)
    return dict(kwargs)


def logit_processing(args: Any) -> dict[str, Any]:
    """The sampling settings of a GRPOConfig that make vLLM's logprobs differ from the trainer's, as
    {field: value} ("generation_kwargs['k']" for an entry there, which overrides the field)."""
    kwargs = _generation_kwargs(args)
    found = {}
    for key in SAMPLING_KWARGS:
        if key in kwargs:
            name, value = f"generation_kwargs[{key!r}]", kwargs[key]
        else:
            name, value = key, getattr(args, key, None)
        if not _is_neutral(key, value):
            found[name] = value
    return found


def check_sampling(args: Any, allow: bool = False, *, warn: bool = True) -> dict[str, Any]:
    """The logit-processing settings of `args` (a GRPOConfig): ConfigError naming each unless `allow`,
    then a RuntimeWarning (when `warn`). See the module docstring for why."""
    found = logit_processing(args)
    if not found:
        return found
    named = ", ".join(f"{k}={v!r}" for k, v in found.items())
    why = ("vLLM then reports the logprobs of the filtered or penalised distribution it sampled from "
           "(TRL asks for processed_logprobs) while the trainer scores log_softmax(logits / T), so every "
           "step shows a mismatch that is the sampler's, not a bug")
    if not allow:
        raise ConfigError(
            f"GRPOConfig sets {named}: {why}. Use TRL's defaults (top_p=1.0, top_k=0, min_p=None, "
            "repetition_penalty=1.0, no filter or penalty in generation_kwargs), or pass "
            "TRLOptions(allow_logit_processing=True) to monitor anyway (the mismatch is then counted)"
        )
    if warn:
        warnings.warn(f"rlcheck: GRPOConfig sets {named} (allow_logit_processing=True): {why}; the "
                      "settings are recorded in the dumps' context", RuntimeWarning, stacklevel=3)
    return found
