"""Faults of multi-turn rollouts (a multi-turn task: `rlcheck demo --task calculator`): how the loop's
episodes are built (`TurnPlan`, read by `rlcheck.loop.agent`), as agent frameworks get it wrong.

| fault                     | what goes wrong (where it was reported)                                  | cause diagnose names |
|---------------------------|--------------------------------------------------------------------------|----------------------|
| retokenized-history       | each next prompt re-rendered from the decoded messages (TRL #5224)       | retokenized_history |
| stripped-history          | ... by a template that drops earlier turns' reasoning (prime-rl #947)    | stripped_history |
| missing-generation-prompt | the trainer's turns >= 1 without the assistant header (verifiers #476)   | missing_generation_prompt |
| join-token-mask           | the template's newline after a sampled eos counted as a model token (verl) | join_token_mask |
| tool-tokens-in-loss       | the tool's reply counted as model tokens (rllm #497)                     | tool_tokens_in_loss |
| turn-logprobs-missing     | a turn's engine logprobs missing, filled with 0.0 (rllm #816, OpenRLHF)  | turn_logprobs_missing |
| stale-turn                | the weight sync lands between turns: turn 0 from the old weights (slime #1781) | stale_turn_weights |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault

HISTORIES = ("tokens", "text", "stripped")
TRAINER_SIDES = ("engine", "no-generation-prompt")


@dataclass(frozen=True)
class TurnPlan:
    """How one step's episodes are built and scored; the default is the healthy, token-in/token-out loop."""

    history: str = "tokens"
    """Each next prompt: "tokens" (the previous prompt + the turn's sampled ids + the tool's suffix ids),
    "text" (the chat template's render of the decoded messages, tokenised again), "stripped" (the same,
    earlier turns' reasoning left out by the template)."""
    trainer: str = "engine"
    """What the trainer scores: "engine" (the last prompt and turn, as the engine had them), or
    "no-generation-prompt" (turns >= 1 without the assistant header before them)."""
    join_in_loss: bool = False
    """The newline the template writes after each sampled eos is masked as the turn's last model token."""
    tool_in_loss: bool = False
    """The tool's reply tokens are masked as model tokens."""
    missing_logprobs_turn: int | None = None
    """This turn's engine logprobs are missing and filled with 0.0 (None: none missing)."""
    sync_before_turn: int | None = None
    """The weight sync the last update skipped happens before this turn (None: at the step's end)."""

    def __post_init__(self) -> None:
        if self.history not in HISTORIES or self.trainer not in TRAINER_SIDES:
            raise ConfigError(f"TurnPlan: history in {HISTORIES} and trainer in {TRAINER_SIDES}, got "
                              f"{self.history!r}, {self.trainer!r}")

    @property
    def healthy(self) -> bool:
        return self == TurnPlan()


HEALTHY = TurnPlan()


class TurnFault(Fault):
    """A fault of the episodes' construction: `plan` from `start` on, the healthy plan before."""

    plan: ClassVar[TurnPlan] = HEALTHY
    multi_turn: ClassVar[bool] = True
    """Needs a multi-turn task (the loop refuses it on a single-turn one)."""

    def turn_plan(self, step: int) -> TurnPlan:
        return self.plan if self.active(step) else HEALTHY


@dataclass(frozen=True)
class RetokenizedHistory(TurnFault):
    """Each next prompt is the chat template's render of the messages (the turns decoded and parsed),
    tokenised again. Shape: where a turn's sampled ids are not the canonical tokenization of its text,
    the next prompt stops extending it inside that turn; the trainer, scoring the last prompt, holds
    other ids from there on."""

    name = "retokenized-history"
    cause = "retokenized_history"
    shape = "turn k+1's prompt leaves turn k's ids inside turn k; trainer ids differ from there"
    plan = TurnPlan(history="text")


@dataclass(frozen=True)
class StrippedHistory(TurnFault):
    """The next prompts are rendered by a template that drops every earlier turn's reasoning
    (`<think>...</think>`). Shape: turn k+1's prompt breaks at turn k's first token (its `<think>`)
    and resumes after its reasoning; every turn but the last scored by the trainer without it."""

    name = "stripped-history"
    cause = "stripped_history"
    shape = "the prefix breaks at an earlier turn's <think>; earlier turns off, the last clean"
    plan = TurnPlan(history="stripped")


@dataclass(frozen=True)
class MissingGenerationPrompt(TurnFault):
    """The trainer's sequence renders turns >= 1 without the assistant header the engine had
    (add_generation_prompt left out). Shape: the first tokens of every turn from the second on far
    off, their bodies close, turn 0 clean."""

    name = "missing-generation-prompt"
    cause = "missing_generation_prompt"
    shape = "a spike on the first tokens of turns >= 1; turn 0 clean"
    plan = TurnPlan(trainer="no-generation-prompt")


@dataclass(frozen=True)
class JoinTokenMask(TurnFault):
    """The newline the chat template writes after each sampled eos (verl's inserted join token) is
    masked as a model token, with the engine logprob 0.0 it never sampled. Shape: one loss token
    with engine logprob exactly 0.0 at the end of every turn but the last."""

    name = "join-token-mask"
    cause = "join_token_mask"
    shape = "a loss token with engine logprob exactly 0.0 at each turn's end"
    plan = TurnPlan(join_in_loss=True)


@dataclass(frozen=True)
class ToolTokensInLoss(TurnFault):
    """The tool's replies are masked as model tokens (engine logprob 0.0). Shape: whole loss-mask runs
    with engine logprob exactly 0.0, the trainer's far below 0 on the reply's digits."""

    name = "tool-tokens-in-loss"
    cause = "tool_tokens_in_loss"
    shape = "whole loss runs with engine logprob 0.0 and trainer logprob far below"
    plan = TurnPlan(tool_in_loss=True)


@dataclass(frozen=True)
class TurnLogprobsMissing(TurnFault):
    """Turn `turn`'s engine logprobs are missing and filled with 0.0 (OpenRLHF's fill; rllm's zero
    padding). Shape: a whole model turn of exact zeros, the trainer's logprobs below them."""

    turn: int = 1
    name = "turn-logprobs-missing"
    cause = "turn_logprobs_missing"
    shape = "a whole turn of engine logprobs exactly 0.0"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.turn < 0:
            raise ConfigError(f"turn-logprobs-missing needs a turn index >= 0, got {self.turn}")

    def turn_plan(self, step: int) -> TurnPlan:
        return replace(HEALTHY, missing_logprobs_turn=self.turn) if self.active(step) else HEALTHY


@dataclass(frozen=True)
class StaleTurn(TurnFault):
    """The weight sync after each update (from `start`) lands in the next step's episodes, before turn
    `turn`: the turns before it come from the weights one update old, the rest from the new ones (a
    partial rollout across a sync). Shape: the weight version changes inside the trajectories; the
    turns before `turn` off by one update, the rest clean."""

    turn: int = 1
    name = "stale-turn"
    cause = "stale_turn_weights"
    shape = "the weight version changes between turns; the earlier turns off"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.turn < 1:
            raise ConfigError(f"stale-turn needs the turn the sync lands before, >= 1, got {self.turn}")

    def skip_sync(self, step: int) -> bool:
        return self.active(step)

    def turn_plan(self, step: int) -> TurnPlan:
        return replace(HEALTHY, sync_before_turn=self.turn) if step > self.start else HEALTHY


TURN_FAULTS = (RetokenizedHistory, StrippedHistory, MissingGenerationPrompt, JoinTokenMask, ToolTokensInLoss,
               TurnLogprobsMissing, StaleTurn)
