"""The calculator dialogue of the tiny tool-calling model (`build_trained(..., task="calculator")`): its chat
and response templates and training dialogues live with the task in the loop's layer
(`rlcheck.loop.agent.dialogue`, which the episodes read); the names here are theirs, for the model zoo."""

from __future__ import annotations

from rlcheck.loop.agent.dialogue import (
    CHAT_TEMPLATE,
    MAX_OPERAND,
    NUM_OPERANDS,
    RESPONSE_TEMPLATE,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_NAME,
    Dialogues,
    call,
    install_templates,
    operands,
    solution,
    tool_suffix_ids,
)

__all__ = ["CHAT_TEMPLATE", "MAX_OPERAND", "NUM_OPERANDS", "RESPONSE_TEMPLATE", "THINK_CLOSE", "THINK_OPEN",
           "TOOL_NAME", "Dialogues", "call", "install_templates", "operands", "solution", "tool_suffix_ids"]
