"""The TRL adapter's preflight (`rlcheck.preflight`): before GRPOTrainer loads the model and starts vLLM
(`RLCheckGRPOTrainer`), or when attaching to a built trainer (`attach_monitor`), the static checks of
what TRL 1.16 will run on each side:

- engine: vLLM loads the model folder `model` names (`model.name_or_path`), with `dtype="auto"` (a
  float32 checkpoint runs in bfloat16; on a built trainer, the dtype its vLLM runs in), `logprobs_mode="processed_logprobs"`, prefix caching on, and
  TRL resets the prefix cache after every weight sync (colocate and server mode; rlcheck's own reload
  sync too), so no `prefix_cache` finding;
- trainer: the model as TRL holds it (a model object's config may differ from the folder's, e.g. a
  RoPE setting changed in code), scoring log_softmax(logits / temperature) in bfloat16 under `bf16=True`
  (TRL's default), float16 under `fp16`, else in the model's dtype.
Sampling filters are `check_sampling`'s (refused, or warned about with `allow_logit_processing`), so the
preflight leaves them out. Findings print as one warning block; critical ones are refused (`ConfigError`);
they go into the Monitor's context as "preflight" (`trl_context`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcheck.integrations.trl.config import TRLOptions, check_config, check_sampling, trainer_dtype
from rlcheck.preflight import Finding, PreflightConfig, attach_check, load_side, side_of_model

WHERE = "TRL, before vLLM starts"


def started_dtype(trainer: Any) -> str | None:
    """The dtype of the vLLM engine a built GRPOTrainer already started (colocate mode), else None."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def trl_preflight(args: Any, model: Any, tokenizer: Any = None, *, engine_dtype: str | None = None,
                  where: str = WHERE) -> tuple[Finding, ...]:
    """The static preflight of a GRPOConfig and the model GRPOTrainer gets (a folder path or a model
    object); `engine_dtype`: vLLM's, when it is running already (else TRL's "auto"); () when there is
    no local model folder to read (a hub id, a stand-in)."""
    path = model if isinstance(model, str) else getattr(model, "name_or_path", None)
    if not path or not Path(path).is_dir():
        return ()
    trainer = (load_side("trainer", path, tokenizer=tokenizer) if isinstance(model, str)
               else side_of_model("trainer", model, tokenizer))
    engine = load_side("engine", path, with_tokenizer=False)  # TRL sends vLLM token ids it tokenized itself
    cfg = PreflightConfig(model=path, temperature=float(getattr(args, "temperature", 1.0) or 1.0),
                          logprobs_mode="processed_logprobs", dtype=engine_dtype or "auto",
                          trainer_dtype=trainer_dtype(args, model), resets_prefix_cache=True)
    return attach_check(cfg, trainer, engine, where=where)


def check_before_start(config: Any, options: TRLOptions, args: tuple, kwargs: dict) -> tuple[Finding, ...] | None:
    """`RLCheckGRPOTrainer.__init__`, before GRPOTrainer's: what needs only the GRPOConfig (ConfigError),
    then the preflight of its model; None without a GRPOConfig (the hook runs the preflight later)."""
    if config is None:
        return None
    check_config(config)
    check_sampling(config, options.allow_logit_processing, warn=False)
    model = kwargs.get("model", args[0] if args else None)
    return trl_preflight(config, model, kwargs.get("processing_class", args[5] if len(args) > 5 else None))


def check_attach(trainer: Any, options: TRLOptions) -> None:
    """`RLCheckHook`: the sampling check, and the preflight unless `RLCheckGRPOTrainer` ran it already
    (its findings on `trainer.rlcheck_preflight`)."""
    check_sampling(trainer.args, options.allow_logit_processing)
    if getattr(trainer, "rlcheck_preflight", None) is None and getattr(trainer, "model", None) is not None:
        trainer.rlcheck_preflight = trl_preflight(trainer.args, trainer.model, getattr(trainer, "processing_class", None),
                                                  engine_dtype=started_dtype(trainer), where="TRL, attach_monitor")
