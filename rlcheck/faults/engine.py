"""Engine-level faults of `rlcheck.engines.vllm_faults`, injected into the loop's rollout engine: the
Mamba state faults (vllm 0.32, in-process, a model with Mamba2 layers; refused otherwise) and
perturb-layer (one decoder layer's output projection scaled inside vLLM; any model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault


@dataclass(frozen=True)
class StaleState(Fault):
    """A request whose state slot was held before starts from the state its previous holder left
    (vLLM's decode-before-prefill bug). Shape: once slots are reused (from the second step on),
    sequences far off from their first tokens; the first wave is clean."""

    name = "stale-state"
    cause = "stale_state"
    shape = "reused slots: far off from the first tokens"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start:
            raise ConfigError("stale-state acts from the first step (it is set up with the engine)")

    def engine_fault(self) -> tuple[str, dict[str, Any]] | None:
        return "stale-state", {}


@dataclass(frozen=True)
class IndexWrap(Fault):
    """State slots at or past `boundary` alias slot % boundary (a wrapped 32-bit offset). Shape: with
    more live requests than slots below the boundary, requests share state: far off from their
    second token; gone when concurrency or memory is cut."""

    boundary: int = 16
    name = "index-wrap"
    cause = "index_aliasing"
    shape = "more concurrency than the boundary: shared state"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.boundary < 1:
            raise ConfigError(f"index-wrap needs a boundary >= 1, got {self.boundary}")
        if self.start:
            raise ConfigError("index-wrap acts from the first step (it is set up with the engine)")

    def engine_fault(self) -> tuple[str, dict[str, Any]] | None:
        return "index-wrap", {"boundary": self.boundary}

    def value(self) -> str:
        return str(self.boundary)


@dataclass(frozen=True)
class PerturbLayer(Fault):
    """Inside the rollout engine only, decoder layer `layer`'s output projection (attention o_proj, or
    the Mamba mixer's out_proj) computes 1.01 x its output, again after every weight sync
    (`rlcheck.engines.vllm_perturb`). Shape: every sequence a little off from its first token, the
    same layer first in each (`rlcheck localize` names it); the trainer and the reference agree."""

    layer: int = 0
    name = "perturb-layer"
    cause = "weights_out_of_sync"
    shape = "one engine layer off: every sequence, from the first token"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer < 0:
            raise ConfigError(f"perturb-layer needs a decoder layer index >= 0, got {self.layer}")
        if self.start:
            raise ConfigError("perturb-layer acts from the first step (it is set up with the engine)")

    def engine_fault(self) -> tuple[str, dict[str, Any]] | None:
        return "perturb-layer", {"layer": self.layer}

    def value(self) -> str:
        return str(self.layer)


@dataclass(frozen=True)
class MoeRouteFlip(Fault):
    """Inside the rollout engine only, each MoE router swaps its k-th and (k+1)-th experts on a
    fraction `p` of the tokens where the two are within a near-tie (`rlcheck.engines.moe_routing`),
    as bf16 router noise does. Shape: routing agreement below 1, the mismatch carried by the rerouted
    tokens (`rlcheck/moe/*` when the batch carries routing); an MoE model."""

    p: float = 0.1
    name = "moe-route-flip"
    cause = "moe_routing"
    shape = "near-tie tokens rerouted in the engine: they carry the mismatch"
    takes_value = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.p <= 1.0:
            raise ConfigError(f"moe-route-flip needs a fraction of near-tie tokens in (0, 1], got {self.p}")
        if self.start:
            raise ConfigError("moe-route-flip acts from the first step (it is set up with the engine)")

    def engine_fault(self) -> tuple[str, dict[str, Any]] | None:
        return "moe-route-flip", {"flip": self.p}

    def value(self) -> str:
        return f"{self.p:g}"
