"""The calculator dialogue: the chat template, the response template and the training dialogues of the
tiny tool-calling model (`build_trained(..., task="calculator")`, folder `runs/models/<arch>-calculator`), in
the loop's layer with the task (`rlcheck.modelzoo.calculator` re-exports them for the model zoo).

A problem is a sum of `NUM_OPERANDS` numbers; the model adds them with a tool, one pair per call, and
thinks before each call, as reasoning models do:

    <|bos|><|user|>\\n12+7+5<|eos|>\\n<|assistant|>\\n<think>12+7</think>add(a=12, b=7)<|eos|>
    \\n<|user|>\\n19<|eos|>\\n<|assistant|>\\n<think>19+5</think>add(a=19, b=5)<|eos|>
    \\n<|user|>\\n24<|eos|>\\n<|assistant|>\\n<think>24</think>24<|eos|>

The tool's reply comes back as a user turn (the tokenizer has no tool role token). The chat template
renders `tool_calls` and `reasoning_content` (what TRL's `GRPOTrainer(tools=...)` asks of a template:
`trl.chat_template_utils.supports_tool_calling`, prefix-preserving), and with `strip_reasoning=True`
leaves the reasoning out of every assistant turn but the last, as the Qwen3.5 templates do (the
`stripped-history` fault). `RESPONSE_TEMPLATE` is transformers' `response_template` that parses a
generated turn back into that message (`tokenizer.parse_response`, what TRL reads tool calls with).

A share of the training dialogues has its assistant text tokenised with BPE dropout (merges left out
at random), so that the trained model, like a real LM, sometimes samples a tokenization that is not
the canonical one of its text: re-tokenizing the decoded history then gives other ids (TRL #5224).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

NUM_OPERANDS = 3
MAX_OPERAND = 99
TOOL_NAME = "add"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|user|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
    "{% if message.get('reasoning_content') and (loop.last or not strip_reasoning) %}"
    "{{ '<think>' + message['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ message.get('content') or '' }}"
    "{% for call in message.get('tool_calls') or [] %}{{ call['function']['name'] + '(' }}"
    "{% for key, value in call['function']['arguments'].items() %}{{ key + '=' + value | string }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ')' }}{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The model's chat template: the tiny tokenizer's (`rlcheck.modelzoo.tokenizer.CHAT_TEMPLATE`) for
system and user turns, plus tool calls, tool replies (as user turns) and reasoning."""

RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "reasoning_content": {"open": THINK_OPEN, "close": THINK_CLOSE, "content": "text"},
        "tool_calls": {
            "open_pattern": r"(?P<name>[a-z_]+)\(",
            "close": ")",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"(?P<key>\w+)=(?P<value>-?\d+)", "value_parser": {"name": "int"}},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|eos\|>\s*", "content": "text"},
    },
}
"""transformers' `response_template` (>= 5.13) of a generated assistant turn."""


def call(a: int, b: int) -> dict[str, Any]:
    """The tool call message part that adds a and b."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"a": int(a), "b": int(b)}}}


def solution(operands: list[int]) -> list[dict[str, Any]]:
    """The dialogue that solves `operands` with the tool: the user's sum, then per pair a thought, a call
    and the tool's reply, then the answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "+".join(str(x) for x in operands)}]
    total = operands[0]
    for x in operands[1:]:
        messages.append({"role": "assistant", "content": "", "reasoning_content": f"{total}+{x}",
                         "tool_calls": [call(total, x)]})
        total += x
        messages.append({"role": "tool", "name": TOOL_NAME, "content": str(total)})
    messages.append({"role": "assistant", "content": str(total), "reasoning_content": str(total)})
    return messages


def operands(rng: np.random.Generator, count: int = NUM_OPERANDS, max_operand: int = MAX_OPERAND) -> list[int]:
    return [int(x) for x in rng.integers(0, max_operand + 1, count)]


class Dialogues:
    """Training token ids of calculator dialogues: rendered with the chat template, a share of them with
    the assistant turns tokenised under BPE dropout (module docstring)."""

    def __init__(self, tok: Any, max_operand: int = MAX_OPERAND, dropout: float = 0.1, dropout_share: float = 0.3):
        import tokenizers

        self.tok, self.max_operand, self.dropout_share = tok, max_operand, dropout_share
        spec = json.loads(tok.backend_tokenizer.to_str())
        spec["model"]["dropout"] = dropout
        self.dropped = tokenizers.Tokenizer.from_str(json.dumps(spec))

    def ids(self, rng: np.random.Generator) -> list[int]:
        """One dialogue's ids, bos to the answer's eos."""
        messages = solution(operands(rng, max_operand=self.max_operand))
        if rng.random() >= self.dropout_share:
            return list(self.tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=True,
                                                     return_dict=False))
        out: list[int] = []
        for i in range(len(messages)):  # each turn's ids: the render's growth, assistant text re-tokenised
            before = self._render(messages[:i])
            text = self._render(messages[: i + 1])[len(before):]
            if messages[i]["role"] == "assistant":
                head = "<|assistant|>\n"
                body = text[len(head):].removesuffix(self.tok.eos_token + "\n")
                out += self._encode(head) + self.dropped.encode(body, add_special_tokens=False).ids
                out += self._encode(self.tok.eos_token + "\n")
            else:
                out += self._encode(text)
        return out

    def _render(self, messages: list[dict[str, Any]]) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


def install_templates(folder: str | Path) -> None:
    """Write the calculator chat template and response template into a model folder's tokenizer files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    tok.save_pretrained(folder)


def tool_suffix_ids(tok: Any, reply: str) -> list[int]:
    """The ids that follow a model turn's sampled eos when the tool replies `reply`: the render of a
    dialogue with the reply (and the generation prompt) past the render without it, cut after the
    assistant turn's eos, as TRL's `_get_tool_suffix_ids` does ("\\n<|user|>\\n19<|eos|>\\n<|assistant|>\\n":
    the template's newline after the sampled eos is the first of them)."""
    head = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "", "tool_calls": [call(1, 1)]}]
    before = tok.apply_chat_template(head, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(head + [{"role": "tool", "name": TOOL_NAME, "content": reply}],
                                   chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False,
                                   add_generation_prompt=True)
    cut = len(before) - before[::-1].index(tok.eos_token_id)
    if full[:cut] != before[:cut]:
        raise ValueError("the calculator chat template is not prefix-preserving")
    return list(full[cut:])
