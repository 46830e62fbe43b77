"""Faults in what the trainer scores: the token ids it is given differ from the engine's, as a
trainer's own tokenization, chat template or batching makes them differ (`Fault.trainer_inputs`).

The loop lays the trainer's logprobs against the engine's tokens by position
(`rlcheck.loop.trainer_view`): where the trainer has fewer response tokens, the engine's last ones
get logprob 0 and the pad id (what a padded batch holds there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault, TrainerInputs


def special_id(tokenizer: Any, name: str, fault: str) -> int:
    """The tokenizer's `name` ("bos", "eos", "pad") token id; ConfigError when it has none."""
    value = getattr(tokenizer, f"{name}_token_id", None)
    if value is None:
        raise ConfigError(f"{fault} needs a tokenizer with a {name} token; this one has none")
    return int(value)


class _InputFault(Fault):
    """A trainer-input fault acts from `start` on; before it the trainer scores the engine's ids."""

    changes_lengths: ClassVar[bool] = False
    """The trainer's responses may hold another number of tokens than the engine's: the engine's
    top-k rows would not line up, so an engine returning them is refused."""

    def rollout_config(self, cfg):
        if self.changes_lengths and cfg.top_logprobs:
            raise ConfigError(f"{self.name} changes the trainer's response lengths: run it without top-k "
                              "logprobs (VLLMConfig.top_logprobs=0, no --topk)")
        return super().rollout_config(cfg)

    def trainer_inputs(self, step: int, prompts: list[list[int]], responses: list[list[int]], texts: list[str],
                       tokenizer: Any) -> TrainerInputs | None:
        return self.change(prompts, responses, texts, tokenizer) if self.active(step) else None

    def change(self, prompts: list[list[int]], responses: list[list[int]], texts: list[str],
               tokenizer: Any) -> TrainerInputs:
        raise NotImplementedError


@dataclass(frozen=True)
class Retokenize(_InputFault):
    """The trainer re-tokenizes the engine's decoded response text (as multi-turn and tool loops do)
    instead of taking its token ids; the stop token, which the text leaves out, is appended again.
    Shape: the sequences whose sampled ids are not the canonical tokenization of their text (a merge
    the sampler split, bytes of a partial character, a special token the text drops) carry other ids
    from the first such token on; the others match exactly."""

    name = "retokenize"
    cause = "retokenization"
    changes_lengths = True
    shape = "some sequences' ids differ from a mid-sequence token on; the rest match"

    def change(self, prompts, responses, texts, tokenizer) -> TrainerInputs:
        eos = special_id(tokenizer, "eos", self.name)
        out = []
        for ids, text in zip(responses, texts, strict=True):
            again = list(tokenizer.encode(text, add_special_tokens=False))
            again += [eos] if ids and ids[-1] == eos else []
            out.append(again or list(ids))  # nothing to re-tokenize: the trainer keeps the engine's ids
        return TrainerInputs(prompts, out)


@dataclass(frozen=True)
class DoubleBos(_InputFault):
    """The trainer's prompt gets the BOS token twice (the chat template writes one and the tokenizer
    adds another), the engine's once. Shape: every sequence a little off from its first token; the
    trainer's prompt ids are the engine's with one more BOS in front."""

    name = "double-bos"
    cause = "prompt_mismatch"
    shape = "the trainer's prompt has one more BOS: every sequence off from its first token"

    def change(self, prompts, responses, texts, tokenizer) -> TrainerInputs:
        bos = special_id(tokenizer, "bos", self.name)
        return TrainerInputs([[bos, *p] for p in prompts], responses)


@dataclass(frozen=True)
class LeftPadPositions(_InputFault):
    """The trainer left-pads each prompt to the step's longest and scores the rows without position ids
    or an attention mask over the padding: its positions shift by the padding, and the pads are in the
    context. (With the mask, a pure shift is invisible to RoPE, which sees only relative positions:
    8e-6 nats on the tiny Llama.) Shape: rows with padding off from their first token, more with more
    padding; rows of the longest prompt clean."""

    name = "left-pad-positions"
    cause = "position_ids"
    shape = "off in proportion to the row's padding; unpadded rows clean"

    def change(self, prompts, responses, texts, tokenizer) -> TrainerInputs:
        special_id(tokenizer, "pad", self.name)
        width = max(len(p) for p in prompts)
        return TrainerInputs(prompts, responses, [width - len(p) for p in prompts])


@dataclass(frozen=True)
class StopToken(_InputFault):
    """The trainer drops the stop (EOS) token from every response that ends with it, so the engine's
    logprob of it meets a position the trainer did not score (0, the padding value). Shape: the
    mismatch sits on the last token of the sequences that stopped, all the same token id; sequences
    cut by the length limit, and every other token, match."""

    name = "stop-token"
    cause = "stop_token"
    changes_lengths = True
    shape = "the last token of stopped sequences only"

    def change(self, prompts, responses, texts, tokenizer) -> TrainerInputs:
        eos = special_id(tokenizer, "eos", self.name)
        return TrainerInputs(prompts, [r[:-1] if len(r) > 1 and r[-1] == eos else r for r in responses])
