"""What a dump records about how its logprobs were made: meta.json's `context.sampling` and
`context.engine`, one schema that every producer writes (the loop, TRL, verl, `rlcheck stress`) and
every tool reads (replay, localize, diagnose, repro) through `read_context`.

    context = {"model": "runs/models/llama", **record(Sampling(temperature=0.7, logprobs_mode="raw_logprobs"),
                                                      Engine(dtype="bfloat16", configured_dtype="auto"))}
    ctx = read_context(meta)              # a DumpContext, from a dump's meta.json (or its "context")
    ctx.sampling.logprob_temperature()    # (1.0, "dump: raw logprobs, untempered"): what a re-scorer divides by
    ctx.engine.dtype                      # "bfloat16": what the engine ran; None where nobody recorded it

context.sampling (`Sampling`): how the engine sampled and which logprobs it returned.
context.engine (`Engine`): the engine's precision and settings, as it ran them where the producer
could ask it (the loop asks its rollout actor, TRL its in-process LLM, stress its engine).
context.model_type: the model's HF `model_type`, read from its config where the producer had it (what
diagnose needs to know whether a state cause is possible at all).
context.schema: SCHEMA_VERSION.

Dumps written before this schema are read too (`read_context`): the loop's kept `logprobs_mode` under
`engine`, TRL's its settings flat (`temperature`, `top_p`, ..., `vllm_dtype`), stress's `engine` was
the string "vllm". Pure: dicts in, dataclasses out (core/run: no torch, no vLLM).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1
LOGPROB_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass(frozen=True)
class Sampling:
    """How the engine sampled, and what its logprobs are."""

    temperature: float | None = None
    """The sampler's temperature (0 for greedy); None: not recorded."""
    greedy: bool = False
    """Argmax decoding: the logprobs are those of the untempered distribution, log_softmax(logits)."""
    logprobs_mode: str | None = None
    """"processed_logprobs": log-softmax of the logits the token was drawn from (after temperature and
    any processing); "raw_logprobs": of the raw logits (T = 1); None: not recorded."""
    processing: dict[str, Any] = field(default_factory=dict)
    """The logit processing that changes the distribution ({setting: value}: top_p < 1, top_k, min_p,
    penalties); {} for none."""
    max_tokens: int | None = None
    n: int | None = None
    """Samples per prompt."""

    def logprob_temperature(self) -> tuple[float, str]:
        """(T, why): the temperature at which the engine's logprobs were computed, what an independent
        re-scorer (log_softmax(logits / T)) must use: 1 for greedy or raw logprobs, else the sampler's."""
        if self.greedy:
            return 1.0, "dump: greedy, logprobs untempered"
        if self.logprobs_mode == "raw_logprobs":
            return 1.0, "dump: raw logprobs, untempered"
        if self.temperature is not None and self.temperature > 0:
            return float(self.temperature), "dump"
        return 1.0, "default"


@dataclass(frozen=True)
class Engine:
    """The rollout engine: its precision as it ran, and the settings a re-run needs."""

    name: str | None = None
    """"vllm"; None: not recorded."""
    dtype: str | None = None
    """What the engine computed in (torch's name: "bfloat16"), as it ran; None: not recorded."""
    configured_dtype: str | None = None
    """What it was asked for ("auto" kept as such)."""
    enforce_eager: bool | None = None
    tensor_parallel_size: int | None = None
    kv_cache_bytes: int | None = None
    """The cache budget it was given (None: the engine's default, a fraction of the GPU)."""
    max_num_seqs: int | None = None
    engine_id: str | None = None

    @property
    def precision(self) -> str | None:
        """The dtype to judge this engine's numbers at: the one it ran, else the configured one unless
        "auto" (which says nothing); None when neither is known (a judge then takes its loosest)."""
        for d in (self.dtype, self.configured_dtype):
            if d and str(d) != "auto":
                return str(d).removeprefix("torch.")
        return None


@dataclass(frozen=True)
class DumpContext:
    """A dump's context as the tools read it."""

    model: str | None = None
    model_type: str | None = None
    """The model's Hugging Face `model_type` ("llama", "mamba2"), as the producer read it from the model's
    config; None: not recorded (`rlcheck.core.model_types.model_type_at` reads it where the model is here)."""
    framework: str | None = None
    """"loop", "trl", "verl", "stress", or None."""
    sampling: Sampling = field(default_factory=Sampling)
    engine: Engine = field(default_factory=Engine)
    fault: str | None = None
    """The injected fault, as `rlcheck demo --inject` / `rlcheck.faults.Fault.describe` wrote it; None: none."""
    schema: int | None = None
    """SCHEMA_VERSION of the producer; None: written before the schema."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The whole context as written."""


def record(sampling: Sampling, engine: Engine) -> dict[str, Any]:
    """The schema's keys of a context: {"schema", "sampling", "engine"} (merge into the rest)."""
    return {"schema": SCHEMA_VERSION, "sampling": asdict(sampling), "engine": asdict(engine)}


def read_context(meta: dict[str, Any] | None) -> DumpContext:
    """The context of a dump's meta.json (or the context itself: a dict with no "context" key), in
    this schema whoever wrote it (see the module docstring for the older layouts)."""
    meta = meta or {}
    ctx = meta.get("context") if isinstance(meta.get("context"), dict) else meta
    ctx = ctx if isinstance(ctx, dict) else {}
    sampling = ctx.get("sampling") if isinstance(ctx.get("sampling"), dict) else {}
    engine = ctx.get("engine") if isinstance(ctx.get("engine"), dict) else {}
    flat = {k: ctx[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in ctx}
    s = {**_known(Sampling, sampling), **({"temperature": flat["temperature"]} if "temperature" not in sampling
                                           and flat.get("temperature") is not None else {})}
    if "logprobs_mode" not in s and engine.get("logprobs_mode"):  # the loop's layout before the schema
        s["logprobs_mode"] = engine["logprobs_mode"]
    if "processing" not in sampling and isinstance(ctx.get("logit_processing"), dict):  # TRL's
        s["processing"] = dict(ctx["logit_processing"])
    e = _known(Engine, engine)
    if isinstance(ctx.get("engine"), str):  # stress's layout before the schema
        e["name"] = ctx["engine"]
    if "dtype" not in engine and ctx.get("vllm_dtype"):  # TRL's
        e.update(name="vllm", dtype=str(ctx["vllm_dtype"]))
    fault = ctx.get("fault")
    return DumpContext(
        model=ctx.get("model") if isinstance(ctx.get("model"), str) else None,
        model_type=ctx.get("model_type") if isinstance(ctx.get("model_type"), str) else None,
        framework=ctx.get("framework") if isinstance(ctx.get("framework"), str) else None,
        sampling=Sampling(**s), engine=Engine(**e),
        fault=None if not fault or fault == "none" else str(fault),
        schema=ctx.get("schema") if isinstance(ctx.get("schema"), int) else None, raw=dict(ctx))


def _known(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are fields of `cls` (a newer producer's extra keys are left out)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in values.items() if k in names}
