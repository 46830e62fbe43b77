"""What `rlcheck repro` runs and shrinks: a `Case` (the engine's settings, the requests, a weight
update, an injected fault) and the engine knobs it searches (`KNOBS`).

    case = Case(model="runs/models/hybrid", batch=(Request((5, 6, 7), 4),), knobs=(("enforce_eager", True),))
    case.standalone()          # the CASE dict of repro.py (`rlcheck.forensics.repro.standalone`)
    case.with_knob("max_num_seqs", 1); case.without_knob("enforce_eager")

A knob is a `vllm.LLM` keyword set to something other than vLLM's own default; `Case.knobs` holds
only those (the changes), `Case.base` the settings every probe keeps (dtype, seed, max_model_len, the
cache budget in bytes). Undoing a knob change means dropping it: vLLM's default again. The dtype is
never left to vLLM's "auto", which casts a float32 checkpoint to bfloat16 on CPU and GPU alike
(vllm/config/model.py, "Downcast for float32 models"), a precision the float32 reference cannot judge
at float32's threshold: it is in `base`, and the knob table tries the other one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from rlcheck.core.limits import ENGINE_TOL, FP32_ENGINE_TOL

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""The engine in the script's own process (rlcheck's probes and hooks need it; a single process is
also the simplest program to hand over)."""
UPDATE = {"seed": 0, "scale": 0.01}
"""The weight update of a case that has one (`standalone.weight_update`): 1% of each tensor's RMS."""


class Knob(NamedTuple):
    name: str  # the vllm.LLM keyword
    label: str  # as the report names it
    ladder: tuple[Any, ...]  # values the knob table tries (besides the case's own); () = computed


KNOBS = (
    Knob("max_num_seqs", "max_num_seqs (concurrent sequences)", (1, 2, 4, 8, 64)),
    Knob("num_gpu_blocks_override", "KV-cache blocks", ()),
    Knob("enable_prefix_caching", "prefix caching", (False, True)),
    Knob("enable_chunked_prefill", "chunked prefill", (False, True)),
    Knob("max_num_batched_tokens", "max_num_batched_tokens", (16, 64)),
    Knob("block_size", "block size", (16, 64)),
    Knob("dtype", "dtype", ("bfloat16", "float32")),
    Knob("enforce_eager", "eager (enforce_eager) vs compiled", (True, False)),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)
SLOW_KNOBS = ("enforce_eager",)
"""Undone last: without it vLLM compiles the model (tens of seconds an engine on CPU)."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    origin: str = ""
    """Where it came from: the run's request id."""

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_token_ids": list(self.prompt), "max_tokens": self.max_tokens}

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.max_tokens


@dataclass(frozen=True)
class Case:
    model: str
    batch: tuple[Request, ...]
    """The requests judged, submitted together in this order."""
    history: tuple[Request, ...] = ()
    """Requests the engine serves first (the run's earlier steps): they leave their state behind."""
    knobs: tuple[tuple[str, Any], ...] = ()
    """vllm.LLM keywords set to other than vLLM's default (names from KNOBS), sorted."""
    base: tuple[tuple[str, Any], ...] = ()
    """vllm.LLM keywords every probe keeps (dtype, seed, max_model_len, kv_cache_memory_bytes)."""
    weight_update: bool = False
    """A weight sync (`UPDATE`) before the batch, as the run's engine had taken."""
    fault: str | None = None
    """An injected engine fault (`rlcheck.engines.vllm_plugin`, the RLCHECK_VLLM_FAULT spelling)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", tuple(sorted(self.knobs)))
        unknown = [k for k, _ in self.knobs if k not in KNOB_NAMES]
        if unknown:
            raise ValueError(f"not knobs: {unknown}")

    # ---- reading -------------------------------------------------------------------------------

    @property
    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)

    @property
    def dtype(self) -> str:
        return str(self.engine().get("dtype", "auto"))

    @property
    def threshold(self) -> float:
        """Max |d| (nats) a batch request may be off: float32 passes agree to ~1e-5, lower precisions to ~0.2."""
        return FP32_ENGINE_TOL if self.dtype in ("float32", "float") else ENGINE_TOL

    @property
    def requests(self) -> tuple[Request, ...]:
        return self.history + self.batch

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus tokens to generate, over every request."""
        return sum(r.num_tokens for r in self.requests)

    def engine(self) -> dict[str, Any]:
        return {**dict(self.base), **self.knob_dict}

    def standalone(self, model: str | None = None) -> dict[str, Any]:
        """The CASE of repro.py (`rlcheck.forensics.repro.standalone`); `model` replaces the model path."""
        return {"model": model or self.model, "env": dict(ENV), "engine": self.engine(),
                "history": [r.to_dict() for r in self.history], "batch": [r.to_dict() for r in self.batch],
                "weight_update": dict(UPDATE) if self.weight_update else None, "threshold": self.threshold,
                "fault": self.fault}

    def key(self) -> str:
        """Equal for cases that run the same."""
        return hashlib.sha1(json.dumps(self.standalone(), sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        """One line: requests, tokens, knob changes."""
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs) or "none"
        hist = f" after {len(self.history)} earlier" if self.history else ""
        update = "; a weight update before the batch" if self.weight_update else ""
        return (f"{len(self.batch)} batch request(s){hist} ({self.num_tokens} tokens: prompts + max_tokens); "
                f"knob changes: {knobs}{update}")

    # ---- changing ------------------------------------------------------------------------------

    def with_knob(self, name: str, value: Any) -> Case:
        return replace(self, knobs=tuple({**self.knob_dict, name: value}.items()))

    def without_knob(self, name: str) -> Case:
        return replace(self, knobs=tuple((k, v) for k, v in self.knobs if k != name))

    def with_requests(self, history: tuple[Request, ...], batch: tuple[Request, ...]) -> Case:
        return replace(self, history=history, batch=batch)
