"""The multi-turn faults in the own loop: how each makes the loop's episodes go wrong (`TurnPlan`), where
the bug lives in a real agent loop, so that the evidence comes from the real engine and trainer
(`rlcheck.loop.agent` reads the plan; the batch-level `apply` of `rlcheck.faults.turns` is for other
batches and does not run there).

| fault                     | what the loop does wrong (where it was reported)                           |
|---------------------------|----------------------------------------------------------------------------|
| retokenized-history       | each next prompt re-rendered from the decoded messages (TRL #5224)         |
| stripped-history          | ... by a template that drops earlier turns' reasoning (prime-rl #947)      |
| missing-generation-prompt | the trainer's turns >= 1 without the assistant header (verifiers #476)     |
| join-token-mask           | the template's newline after a sampled eos masked as a model token (verl)  |
| tool-tokens-in-loss       | the tool's replies masked as model tokens (rllm #497)                      |
| turn-logprobs-missing     | turn 1's engine logprobs missing, filled with 0.0 (rllm #816, OpenRLHF)    |
| stale-turn                | the sync after an update lands between turn 0 and turn 1 of the next step's |
|                           | episodes (slime #1781): turn 0 from the weights one update old             |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.faults.turns import (
    JoinTokenMask,
    MissingGenerationPrompt,
    RetokenizedHistory,
    StaleTurn,
    StrippedHistory,
    ToolTokensInLoss,
    TurnFault,
    TurnLogprobsMissing,
)

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


HEALTHY = TurnPlan()
PLANS: dict[type, TurnPlan] = {
    RetokenizedHistory: TurnPlan(history="text"),
    StrippedHistory: TurnPlan(history="stripped"),
    MissingGenerationPrompt: TurnPlan(trainer="no-generation-prompt"),
    JoinTokenMask: TurnPlan(join_in_loss=True),
    ToolTokensInLoss: TurnPlan(tool_in_loss=True),
    TurnLogprobsMissing: TurnPlan(missing_logprobs_turn=1),
    StaleTurn: TurnPlan(sync_before_turn=1),
}


def turn_plan(fault: Any, step: int) -> TurnPlan:
    """The plan of `fault` for this step's episodes: its own once it acts (stale-turn: from the step after
    its start, whose update's sync it moved), the healthy one for any other fault."""
    if not isinstance(fault, TurnFault):
        return HEALTHY
    acting = step > fault.start if isinstance(fault, StaleTurn) else fault.active(step)
    return PLANS[type(fault)] if acting else HEALTHY


def apply_in_loop(fault: Any, step: int, batch: Any) -> tuple[Any, list[str]]:
    """`fault.apply(step, batch)` in a loop that runs the fault for real: a multi-turn fault's is left
    out (the own loop's episodes and TRL's tool loop went wrong themselves; its `apply` would add made-up
    evidence to the real)."""
    return (batch, []) if isinstance(fault, TurnFault) else fault.apply(step, batch)
