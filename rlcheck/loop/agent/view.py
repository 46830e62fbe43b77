"""What the trainer scores of the step's episodes, and the monitor's batch of them.

    view = episode_view(episodes, plan, tokenizer)        # the trainer's ids, turn by turn
    logp_train, _, _ = recompute(group, view.seqs, plan, ...)
    batch = view.step_batch(episodes, logp_train)         # engine layout, model tokens masked in
    group.train_step(view.update_inputs(adv, logp_train, weights, loss_tokens), plan)

The trainer scores what the engine saw last: the last turn's prompt and its sampled ids. Healthy,
that is turn 0's prompt followed by every turn and every tool suffix as sampled and appended (the
episode's own layout). Its response is cut into the same parts as the episode's (turn 0, suffix 0,
turn 1, ..., the last turn; `Episode.segments`), and each part's logprobs and ids are laid against the
engine's part of the same turn by position (cut or padded as a padded batch would be:
`rlcheck.loop.trainer_view.fit`), so a turn whose ids differ, or a context that differs before a
turn, shows on that turn. A re-rendered history (`TurnPlan.history` "text" or "stripped") is cut at
the chat template's assistant headers and their eos; a trainer side without the generation prompt
("no-generation-prompt") is the episode with each suffix's assistant header left out.

The mask marks the model's tokens (the turns: 1, the tool suffixes: 0), as the fault's plan leaves it:
the whole reply counted in (the loop still knows where its turns are: the reply's tokens stay tool
tokens, in the loss), or the join newline (put into the turn it follows, as verl's builder attaches
the ids it inserts: the turns are then that mask's runs, each call's record kept); the update's loss
weights are the mask times the monitor's weights, laid back onto the trainer's parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
from rlcheck.core.turns import TurnRecord
from rlcheck.faults.turn_plan import TurnPlan
from rlcheck.loop.agent.episodes import Episode
from rlcheck.loop.trainer_view import fit
from rlcheck.trainers import Sequences

GENERATION_PROMPT = "<|assistant|>\n"


@dataclass(frozen=True)
class TrainerSide:
    """One episode as the trainer scores it."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    segments: tuple[int, ...]
    """Lengths of the response's parts, one per part of the episode's (`Episode.segments`)."""


def lay(values: np.ndarray, source: Sequence[int], target: Sequence[int], fill: float | int) -> np.ndarray:
    """`values`, cut into parts of lengths `source`, each part cut or padded with `fill` to the length
    of the same part in `target`, concatenated ((sum(target),) of values' dtype)."""
    values = np.asarray(values)
    ends = np.cumsum([0, *source])
    parts = [fit(values[ends[i]:ends[i + 1]], n, fill) for i, n in enumerate(target)]
    return np.concatenate(parts) if parts else values[:0]


def episode_mask(ep: Episode, plan: TurnPlan) -> np.ndarray:
    """(len(response),) bool: the turns' tokens, and what the plan adds of the suffixes."""
    parts = []
    for k, n in enumerate(ep.segments):
        if k % 2 == 0:
            parts.append(np.ones(n, dtype=bool))
        else:
            m = np.full(n, plan.tool_in_loss, dtype=bool)
            m[:1] |= plan.join_in_loss  # the template's newline after the sampled eos
            parts.append(m)
    return np.concatenate(parts)


def trainer_side(ep: Episode, plan: TurnPlan, tok: Any) -> TrainerSide:
    """The trainer's ids of `ep` (module docstring)."""
    if plan.history != "tokens":
        return _rendered_side(ep, tok)
    if plan.trainer == "no-generation-prompt":
        header = len(tok.encode(GENERATION_PROMPT, add_special_tokens=False))
        response: list[int] = []
        lengths: list[int] = []
        ends = np.cumsum([0, *ep.segments])
        for k in range(len(ep.segments)):
            part = list(ep.token_ids[ends[k]:ends[k + 1]])
            part = part[:-header] if k % 2 == 1 else part  # a suffix: its generation prompt left out
            response += part
            lengths.append(len(part))
        return TrainerSide(tuple(ep.prompt_token_ids), tuple(response), tuple(lengths))
    return TrainerSide(tuple(ep.prompt_token_ids), tuple(ep.token_ids), tuple(ep.segments))


def _rendered_side(ep: Episode, tok: Any) -> TrainerSide:
    """The last prompt + the last turn, cut at the template's assistant headers: each turn runs from
    after its header through its eos; the first header's end closes the prompt."""
    last = ep.turns[-1]
    ids = list(last.prompt_ids) + list(last.output_ids)
    header = tok.encode(GENERATION_PROMPT, add_special_tokens=False)
    starts = [i + len(header) for i in range(len(ids) - len(header) + 1) if ids[i:i + len(header)] == header]
    if len(starts) != len(ep.turns):  # not the episode's structure: lay the whole response by position
        cut = len(ep.prompt_token_ids)
        return TrainerSide(tuple(ids[:cut]), tuple(ids[cut:]), (len(ids) - cut,) + (0,) * (len(ep.segments) - 1))
    bounds: list[int] = []
    for k, s in enumerate(starts):
        end = len(ids) if k == len(starts) - 1 else _after_eos(ids, s, starts[k + 1], tok.eos_token_id)
        bounds += [s, end]
    prompt = ids[: starts[0]]
    edges = [b - starts[0] for b in bounds] + [len(ids) - starts[0]]
    lengths = [edges[i + 1] - edges[i] for i in range(len(edges) - 2)]
    return TrainerSide(tuple(prompt), tuple(ids[starts[0]:]), tuple(lengths))


def _after_eos(ids: list[int], start: int, stop: int, eos: int) -> int:
    """The index after the first eos in ids[start:stop] (stop when there is none)."""
    for i in range(start, stop):
        if ids[i] == eos:
            return i + 1
    return stop


@dataclass(frozen=True)
class EpisodeView:
    seqs: Sequences
    """What the trainer scores and trains on."""
    episodes: tuple[Episode, ...]
    sides: tuple[TrainerSide, ...]
    plan: TurnPlan
    pad_id: int = 0

    def rollouts(self, rollouts: Sequence[Any]) -> list[Any]:
        return list(rollouts)

    def masks(self) -> list[np.ndarray]:
        """Each episode's loss mask over the trainer's response (`episode_mask` laid onto its parts: a
        token of a turn the engine returned no logprob for is left out, as `StepBatch.from_turns` does)."""
        return [lay(episode_mask(ep, self.plan), ep.segments, side.segments, False)
                for ep, side in zip(self.episodes, self.sides, strict=True)]

    def step_batch(self, rollouts: Sequence[Any], logp_train: Sequence[np.ndarray], topk: Any = None,
                   routing: Any = None) -> StepBatch:
        """The monitor's `StepBatch` over what the trainer scored (its ids, its logprobs), each turn's engine
        logprobs laid onto that turn's part (0.0 on the tool's), the turns explicit, and per episode what the
        engine ran (`TurnRecord`: each call's prompt, sampled ids, logprob count, weight version); the
        sequence's weight version is its last turn's."""
        eps, sides = self.episodes, self.sides
        index = [_turn_index(side.segments) for side in sides]
        records = [TurnRecord([t.prompt_ids for t in ep.turns], [t.output_ids for t in ep.turns],
                              [len(t.logprobs) for t in ep.turns], [t.weight_version for t in ep.turns],
                              num_turns=len(ep.turns)) for ep in eps]
        meta = {"vllm_request_id": [e.vllm_request_id for e in eps], "prompt_index": [e.prompt_index for e in eps],
                "sample_index": [e.sample_index for e in eps], PROMPT_TOKENS_TRAIN: [list(s.prompt) for s in sides]}
        ids = [np.asarray(s.response, dtype=np.int64) for s in sides]
        batch = StepBatch.from_ragged(
            [lay(ep.logprobs, ep.segments, side.segments, 0.0) for ep, side in zip(eps, sides, strict=True)],
            [np.asarray(lp, dtype=np.float32) for lp in logp_train], [e.request_id for e in eps], ids,
            mask=self.masks(), tokens_train=ids, prompt_tokens=[np.asarray(e.prompt_token_ids) for e in eps],
            meta=meta, weight_version=[e.weight_version for e in eps], turns=index, turn_records=records)
        # a builder that puts the join newline into the turn: the turns are the runs of its mask (verl's)
        return batch.with_turns("mask_runs", records=batch.turns.records) if self.plan.join_in_loss else batch

    def touched_ids(self, rollouts: Sequence[Any]) -> list[str]:
        """Episodes the fault changed: other trainer ids than the engine's, a mask with suffix tokens
        in, a turn's logprobs lost, or turns from different weight versions."""
        plan = self.plan
        out = []
        for ep, side in zip(self.episodes, self.sides, strict=True):
            differs = side.prompt != tuple(ep.prompt_token_ids) or side.response != tuple(ep.token_ids)
            versions = len({t.weight_version for t in ep.turns}) > 1
            masked = (plan.join_in_loss or plan.tool_in_loss) and len(ep.turns) > 1
            lost = plan.missing_logprobs_turn is not None and len(ep.turns) > plan.missing_logprobs_turn
            if differs or versions or masked or lost:
                out.append(ep.request_id)
        return out

    def update_inputs(self, advantages: Any, logp_train: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None,
                      loss_tokens: int | None) -> Sequences:
        """The update's sequences: the trainer's ids and logprobs, each token's loss weight the mask's
        times the monitor's (the batch is over the trainer's tokens: no laying)."""
        masks = self.masks()
        out = [m.astype(np.float32) * (1.0 if weights is None else np.asarray(w, dtype=np.float32))
               for m, w in zip(masks, weights or [None] * len(masks), strict=True)]
        return self.seqs.with_update_inputs(advantages, logp_train, out, int(sum(int((w > 0).sum()) for w in out)))


def _turn_index(segments: Sequence[int]) -> np.ndarray:
    """(sum(segments),) the turn of each token of parts turn 0, suffix 0, turn 1, ...; -1 on the suffixes."""
    parts = np.arange(len(segments))
    return np.repeat(np.where(parts % 2 == 0, parts // 2, -1), segments)


def episode_view(episodes: Sequence[Episode], plan: TurnPlan, tokenizer: Any) -> EpisodeView:
    """The trainer's side of this step's episodes (module docstring)."""
    sides = tuple(trainer_side(ep, plan, tokenizer) for ep in episodes)
    seqs = Sequences.build([s.prompt for s in sides], [s.response for s in sides])
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0
    return EpisodeView(seqs, tuple(episodes), sides, plan, pad)
