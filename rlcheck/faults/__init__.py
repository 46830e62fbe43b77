"""Faults injected on purpose, to show the monitor catching what it claims (`rlcheck demo --inject`).

A fault is written `NAME[=VALUE][@START]`, e.g. `skip-sync-every=4`, `stale-weights@40`,
`corrupt-seqs=0.02@40`, and acts through hooks the loop calls (`Fault`). The data-level zoo:

| fault                   | VALUE        | shape it should leave                                  | cause diagnose names |
|-------------------------|--------------|--------------------------------------------------------|----------------------|
| skip-sync-every=K       | K >= 2       | a spike every K steps at phase 0 (periodic)            | weights_out_of_sync  |
| stale-weights@S         | -            | mismatch growing with the steps since S (drift)        | weights_out_of_sync  |
| temperature-mismatch=F  | factor != 1  | d follows logp_rollout (systematic slope)              | logit_processing     |
| top-p=P                 | P in (0, 1)  | engine samples top-p, trainer does not: d < 0 (nucleus) | logit_processing    |
| off-by-one              | -            | logp_train[t] ~ logp_rollout[t+1], token ids differ    | token_misalignment   |
| off-by-one-early        | -            | logp_train[t] ~ logp_rollout[t-1], token ids differ    | token_misalignment   |
| bf16-noise=X            | scale > 0    | small symmetric noise everywhere, larger when surprising | numeric_noise      |
| corrupt-seqs=R          | rate in (0,1]| a few sequences far off from their first tokens        | stale_state          |
| drop-sync=PATTERN       | name part    | syncs leave out tensors named *PATTERN*; sync check names their layers | weights_out_of_sync |
| permute-sync=PATTERN    | name part    | syncs roll the rows of tensors named *PATTERN*; sync check names their layers | weights_out_of_sync |
| stale-buffer            | -            | Mamba conv buffers keep old values; sync check names the Mamba layers  | weights_out_of_sync |

In what the trainer scores (`Fault.trainer_inputs`, `rlcheck.faults.inputs`; the loop lays its logprobs
against the engine's tokens by position, `rlcheck.loop.trainer_view`):

| retokenize              | -            | some sequences' ids differ from a mid-sequence token on | retokenization      |
| double-bos              | -            | the trainer's prompt has BOS twice: every sequence off  | prompt_mismatch     |
| left-pad-positions      | -            | off with the row's left padding; unpadded rows clean    | position_ids        |
| stop-token              | -            | the stop token of stopped sequences only                | stop_token          |

In how the engine is set up (`rlcheck.faults.engine_settings`):

| stale-prefix-cache      | -            | prompts sharing a cached prefix off after the syncs      | stale_prefix_cache  |
| rope-mismatch=F         | factor != 1  | engine RoPE base x F: closer early, further off later   | position_dependent  |
| raw-logprobs            | -            | engine logprobs before T = 0.7: d follows logp_rollout   | logit_processing    |

Engine-level (inside the rollout vLLM engine, `rlcheck.engines.vllm_faults`; Mamba models, vllm 0.32;
perturb-layer: any model):

| stale-state             | -            | reused state slots: far off from the first tokens      | stale_state          |
| index-wrap=B            | B >= 1       | more live requests than B slots: shared state          | index_aliasing       |
| perturb-layer=K         | layer K >= 0 | one engine layer x1.01: every sequence, `localize` names K | weights_out_of_sync |
| moe-route-flip=P        | P in (0, 1]  | near-tie tokens rerouted (MoE): they carry the mismatch | moe_routing         |

Multi-turn (on any batch with `StepBatch.turns`, `rlcheck.faults.turns`: the table there):
retokenized-history, stripped-history, missing-generation-prompt, join-token-mask, tool-tokens-in-loss,
turn-logprobs-missing, stale-turn; diagnose names retokenized_history, stripped_history,
missing_generation_prompt, join_token_mask, tool_tokens_in_loss, turn_logprobs_missing, stale_turn_weights.
"""

from __future__ import annotations

from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault, TrainerInputs
from rlcheck.faults.engine import IndexWrap, MoeRouteFlip, PerturbLayer, StaleState
from rlcheck.faults.engine_settings import RawLogprobs, RopeMismatch, StalePrefixCache
from rlcheck.faults.inputs import DoubleBos, LeftPadPositions, Retokenize, StopToken
from rlcheck.faults.turns import TURN_FAULTS
from rlcheck.faults.zoo import (
    Bf16Noise,
    CorruptSequences,
    DropSync,
    OffByOne,
    OffByOneEarly,
    PermuteSync,
    SkipSync,
    StaleBuffer,
    StaleWeights,
    TemperatureMismatch,
    TopP,
)

FAULTS: dict[str, tuple[type[Fault], str | None, type]] = {
    # name: (class, field VALUE sets, VALUE type)
    SkipSync.name: (SkipSync, "every", int),
    StaleWeights.name: (StaleWeights, None, int),
    TemperatureMismatch.name: (TemperatureMismatch, "factor", float),
    TopP.name: (TopP, "p", float),
    OffByOne.name: (OffByOne, None, int),
    OffByOneEarly.name: (OffByOneEarly, None, int),
    Bf16Noise.name: (Bf16Noise, "scale", float),
    CorruptSequences.name: (CorruptSequences, "rate", float),
    DropSync.name: (DropSync, "pattern", str),
    PermuteSync.name: (PermuteSync, "pattern", str),
    StaleBuffer.name: (StaleBuffer, None, int),
    StaleState.name: (StaleState, None, int),
    IndexWrap.name: (IndexWrap, "boundary", int),
    PerturbLayer.name: (PerturbLayer, "layer", int),
    MoeRouteFlip.name: (MoeRouteFlip, "p", float),
    Retokenize.name: (Retokenize, None, int),
    DoubleBos.name: (DoubleBos, None, int),
    LeftPadPositions.name: (LeftPadPositions, None, int),
    StopToken.name: (StopToken, None, int),
    StalePrefixCache.name: (StalePrefixCache, None, int),
    RopeMismatch.name: (RopeMismatch, "factor", float),
    RawLogprobs.name: (RawLogprobs, None, int),
    **{f.name: (f, None, int) for f in TURN_FAULTS},  # multi-turn batches (rlcheck.faults.turns)
}


def parse_inject(spec: str | None, seed: int = 0) -> Fault:
    """`None` or "" -> no fault; `NAME[=VALUE][@START]` -> that fault (ConfigError naming the problem)."""
    if not spec:
        return Fault()
    head, at, start_text = spec.partition("@")
    name, eq, value = head.partition("=")
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))} (as NAME[=VALUE][@START])")
    cls, field, kind = FAULTS[name]
    kwargs: dict = {"seed": seed}
    if at:
        kwargs["start"] = _number(start_text, int, f"{spec!r}: START after '@' must be an integer step")
    if field is None and eq:
        raise ConfigError(f"fault {name} takes no value (write {name} or {name}@START)")
    if field is not None:
        what, example = {int: ("an integer", "4"), float: ("a number", "1.1"), str: ("a name pattern", "mlp")}[kind]
        kwargs[field] = _number(value, kind, f"fault {spec!r}: {name} takes {what}, as {name}={example}")
    return cls(**kwargs)


def _number(text: str, kind: type, message: str):
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(message) from None


__all__ = ["FAULTS", "Bf16Noise", "CorruptSequences", "DoubleBos", "DropSync", "Fault", "IndexWrap", "LeftPadPositions",
           "MoeRouteFlip", "OffByOne", "OffByOneEarly", "PerturbLayer", "RawLogprobs", "Retokenize", "RopeMismatch", "SkipSync",
           "StaleBuffer", "StalePrefixCache", "StaleState", "StaleWeights", "StopToken", "TemperatureMismatch", "TopP",
           "TrainerInputs", "parse_inject"]
