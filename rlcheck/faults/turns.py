"""The multi-turn faults, at the batch level: each corrupts a multi-turn `StepBatch` (one with
`StepBatch.turns`, as an agent loop's adapter builds it) the way the bug it is named after does, in the
numbers and, where the batch records them (`TurnRecord`), in what the engine saw per call. They run on
any multi-turn batch (`rlcheck.synthetic.turns` streams, a real loop's batches) through `Fault.apply`.

| fault                     | what the bug does                                          | cause diagnose names       |
|---------------------------|------------------------------------------------------------|----------------------------|
| retokenized-history       | later calls' prompts re-tokenize an earlier output (TRL    | retokenized_history        |
|                           | #5224, rllm #272): a few ids inside it differ, later turns |                            |
|                           | generated on that context                                  |                            |
| stripped-history          | later calls' prompts lack an earlier turn's first tokens   | stripped_history           |
|                           | (its <think> block, stripped by the template): later turns |                            |
|                           | further off                                                |                            |
| missing-generation-prompt | the trainer's sequence lacks the generation prompt before  | missing_generation_prompt  |
|                           | each later turn (verifiers #476): their first tokens off   |                            |
| join-token-mask           | the join token after a turn (verl's inserted "\\n", SkyRL  | join_token_mask            |
|                           | added_eos) is in the loss, engine logprob 0.0              |                            |
| tool-tokens-in-loss       | the tool's reply is in the loss (rllm #497): engine        | tool_tokens_in_loss        |
|                           | logprob 0.0, the trainer's far below                       |                            |
| turn-logprobs-missing     | a turn's last logprobs are missing, filled with 0.0 (rllm  | turn_logprobs_missing      |
|                           | #816, OpenRLHF)                                            |                            |
| stale-turn                | the first turns come from weights `lag` versions old       | stale_turn_weights         |
|                           | (slime #1781): their mismatch higher, their versions old   |                            |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.turns import TurnRecord, Turns
from rlcheck.errors import ConfigError
from rlcheck.faults.base import Fault


def _perturb(rng: np.random.Generator, lr: np.ndarray, scale: float) -> np.ndarray:
    """The engine's logprobs `lr` under another context: |shift| ~ scale x (1 - p)^0.9 (a near-certain
    token barely moves), signed, kept below 0."""
    shape = (-np.expm1(lr)) ** 0.9
    shift = scale * shape * rng.exponential(1.0, lr.shape[0]) * np.where(rng.random(lr.shape[0]) < 0.5, -1.0, 1.0)
    out = lr + shift
    return np.where(out < 0.0, out, lr - np.abs(shift)).astype(lr.dtype)  # never exactly 0.0: an engine says < 0


@dataclass(frozen=True)
class TurnFault(Fault):
    """A multi-turn fault: acts on `rate` of the sequences with at least `min_turns` turns."""

    rate: float = 1.0
    min_turns: ClassVar[int] = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.rate <= 1:
            raise ConfigError(f"{self.name}: rate must be in (0, 1], got {self.rate}")

    def apply(self, step: int, batch: StepBatch) -> tuple[StepBatch, list[str]]:
        if not self.active(step):
            return batch, []
        if batch.turns is None:
            raise ConfigError(f"{self.name} corrupts multi-turn batches: this one carries no turns "
                              "(StepBatch.from_turns, turns=, with_turns)")
        rng = self.rng(step)
        counts = batch.turns.turn_counts(batch.cu_seqlens)
        picked = np.flatnonzero((counts >= self.min_turns) & (rng.random(batch.num_sequences) < self.rate))
        if picked.size == 0:
            return batch, []
        return self.corrupt(batch, picked, rng, step), [batch.request_ids[i] for i in picked]

    def corrupt(self, batch: StepBatch, picked: np.ndarray, rng: np.random.Generator, step: int) -> StepBatch:
        raise NotImplementedError


def _turn_span(batch: StepBatch, i: int, k: int) -> tuple[int, int]:
    """[start, stop) token indices of turn k of sequence i."""
    runs = batch.turns.runs(batch.cu_seqlens)
    r = int(np.flatnonzero((runs.seq == i) & (runs.turn == k))[0])
    return int(runs.start[r]), int(runs.start[r] + runs.length[r])


def _records(batch: StepBatch) -> list[TurnRecord | None]:
    return list(batch.turns.records or (None,) * batch.num_sequences)


def _with(batch: StepBatch, records=None, **fields) -> StepBatch:
    """`batch` with some fields replaced (and the turns' records, when given)."""
    turns = fields.pop("turns", batch.turns)
    if records is not None:
        turns = Turns(turns.index, turns.tool, turns.source, tuple(records), turns.join)
    return dataclasses.replace(batch, turns=turns, **fields)


class _History(TurnFault):
    """Later calls' prompts carry another version of an earlier turn's output; later turns shifted."""

    scale: ClassVar[float] = 0.3

    def edit(self, out: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def corrupt(self, batch, picked, rng, step):
        lr = batch.logp_rollout.copy()
        records = _records(batch)
        for i in picked.tolist():
            start, _ = _turn_span(batch, i, 1)
            stop = int(batch.cu_seqlens[i + 1])
            lr[start:stop] = np.where(batch.turns.tool[start:stop], lr[start:stop],
                                      _perturb(rng, lr[start:stop], self.scale))
            rec = records[i]
            if rec is not None and rec.prompt_ids is not None and rec.output_ids is not None:
                p0 = rec.prompt_ids[0].shape[0]
                out = rec.output_ids[0]
                new = self.edit(out, rng)
                prompts = [rec.prompt_ids[0]] + [np.concatenate([p[:p0], new, p[p0 + out.shape[0]:]])
                                                 for p in rec.prompt_ids[1:]]
                records[i] = dataclasses.replace(rec, prompt_ids=tuple(prompts))
        return _with(batch, records if batch.turns.records is not None else None, logp_rollout=lr.astype(batch.logp_rollout.dtype))


@dataclass(frozen=True)
class RetokenizedHistory(_History):
    """The loop decodes turn 0's output and tokenizes the text again for the later calls: two of its ids
    merge into another (`edit`); the later turns are generated on that context, the trainer scores them on
    the sampled ids. Shape: the prefix breaks inside turn 0's output; turns >= 1 off, turn 0 clean."""

    name = "retokenized-history"
    cause = "retokenized_history"
    shape = "later calls' prompts differ inside an earlier output; turns >= 1 off"

    def edit(self, out, rng):
        if out.shape[0] < 3:
            return np.concatenate([out[:1] + 1, out[1:]])
        p = int(rng.integers(1, out.shape[0] - 1))
        return np.concatenate([out[:p], [int(out[p]) * 7 + 3], out[p + 2:]])


@dataclass(frozen=True)
class StrippedHistory(_History):
    """The chat template strips turn 0's reasoning (its first `span` tokens, a <think> block) from the
    later calls' prompts; the trainer scores the sequence with it. Shape: the prefix breaks at the start of
    turn 0's output, the engine's ids continue with its later ones; turns >= 1 further off."""

    name = "stripped-history"
    cause = "stripped_history"
    shape = "later calls' prompts lack an earlier turn's first tokens; turns >= 1 off"
    span: int = 16
    scale: ClassVar[float] = 0.5

    def edit(self, out, rng):
        return out[min(self.span, max(out.shape[0] - 1, 1)):]


@dataclass(frozen=True)
class MissingGenerationPrompt(TurnFault):
    """The trainer's sequence lacks the generation prompt (the last `header` tokens of each observation)
    before every turn from the second on: those tokens leave the trained stream, and the trainer finds the
    turns' first tokens unlikely. Shape: a spike on the heads of turns >= 1, turn 0 clean; the trained ids
    before each later turn are the engine's prompt less its last tokens."""

    name = "missing-generation-prompt"
    cause = "missing_generation_prompt"
    shape = "the first tokens of every turn from the second on; turn 0 clean"
    header: int = 2
    head: int = 4

    def corrupt(self, batch, picked, rng, step):
        lt = batch.logp_train.copy()
        drop = np.zeros(batch.num_tokens, dtype=bool)
        for i in picked.tolist():
            for k in range(1, int(batch.turns.turn_counts(batch.cu_seqlens)[i])):
                start, stop = _turn_span(batch, i, k)
                lo = max(start - self.header, int(batch.cu_seqlens[i]))
                if batch.turns.tool[lo:start].all():
                    drop[lo:start] = True
                h = min(self.head, stop - start)
                lt[start:start + h] = lt[start:start + h] - rng.uniform(1.0, 3.0, h)
        keep = ~drop
        seq = np.repeat(np.arange(batch.num_sequences), batch.seq_lens)
        cu = np.concatenate([[0], np.cumsum(np.bincount(seq[keep], minlength=batch.num_sequences))]).astype(np.int64)
        t = batch.turns
        return StepBatch.from_packed(
            batch.logp_rollout[keep], lt[keep], cu, batch.request_ids,
            mask=None if batch.mask is None else batch.mask[keep],
            tokens=None if batch.tokens is None else batch.tokens[keep],
            tokens_train=None if batch.tokens_train is None else batch.tokens_train[keep],
            prompt_tokens=batch.prompt_tokens, meta=batch.meta, weight_version=batch.weight_version,
            turns=Turns(t.index[keep], t.tool[keep], t.source, t.records, t.join))


def _retooled(batch: StepBatch, mask: np.ndarray, tool: np.ndarray, index: np.ndarray) -> Turns:
    """The batch's turns after its mask (and the adapter's view of the tokens) changed: a mask-run batch
    finds its turns again in the new mask."""
    t = batch.turns
    if t.source == "mask_runs":
        return Turns.from_mask(mask, batch.cu_seqlens, records=t.records, join=t.join)
    return Turns(index, tool, t.source, t.records, t.join)


@dataclass(frozen=True)
class JoinTokenMask(TurnFault):
    """The token the framework puts after a turn (a "\\n" after the stop token, an added EOS) goes into
    the loss as the turn's last token, with engine logprob 0.0 (it was never sampled). Shape: a loss
    token with an engine logprob of exactly 0.0 at each turn's end; the trained turn one token longer
    than what the engine sampled."""

    name = "join-token-mask"
    cause = "join_token_mask"
    shape = "a loss token with engine logprob exactly 0.0 at each turn's end"

    def corrupt(self, batch, picked, rng, step):
        mask = np.ones(batch.num_tokens, bool) if batch.mask is None else batch.mask.copy()
        lr, lt = batch.logp_rollout.copy(), batch.logp_train.copy()
        tool, index = batch.turns.tool.copy(), batch.turns.index.copy()
        for i in picked.tolist():
            for k in range(int(batch.turns.turn_counts(batch.cu_seqlens)[i]) - 1):
                _, stop = _turn_span(batch, i, k)
                if stop < batch.cu_seqlens[i + 1] and tool[stop]:
                    mask[stop], tool[stop], index[stop], lr[stop] = True, False, k, 0.0
                    lt[stop] = -max(float(rng.exponential(0.05)), 2e-3)
        return _with(batch, logp_rollout=lr, logp_train=lt, mask=mask, turns=_retooled(batch, mask, tool, index))


@dataclass(frozen=True)
class ToolTokensInLoss(TurnFault):
    """The tool's reply between turns goes into the loss: engine logprob 0.0 (never sampled), the
    trainer's low (text the model did not write). Shape: whole observation runs compared, d far below
    0; with turns from mask runs, turns merge with the replies (fewer turns than the framework's count)."""

    name = "tool-tokens-in-loss"
    cause = "tool_tokens_in_loss"
    shape = "whole observation runs with engine logprob 0.0 in the loss"

    def corrupt(self, batch, picked, rng, step):
        mask = np.ones(batch.num_tokens, bool) if batch.mask is None else batch.mask.copy()
        lt = batch.logp_train.copy()
        for i in picked.tolist():
            a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            obs = np.flatnonzero(batch.turns.tool[a:b]) + a
            obs = obs[obs >= _turn_span(batch, i, 0)[1]]  # the replies after the first turn
            mask[obs] = True
            lt[obs] = np.minimum(lt[obs], -(1.0 + rng.exponential(4.0, obs.shape[0])))
        t = batch.turns
        return _with(batch, logp_train=lt.astype(batch.logp_train.dtype), mask=mask,
                     turns=_retooled(batch, mask, t.tool, t.index))


@dataclass(frozen=True)
class TurnLogprobsMissing(TurnFault):
    """The engine returned too few logprobs for one turn and the adapter filled the rest with 0.0 (a
    short list zero-padded): the last `frac` of that turn's tokens carry engine logprob 0.0, and its
    recorded count is short. Shape: a run of exact zeros inside a turn, the trainer's logprobs ordinary."""

    name = "turn-logprobs-missing"
    cause = "turn_logprobs_missing"
    shape = "runs of engine logprob exactly 0.0 inside a turn; a logprob count short of the tokens"
    frac: float = 0.5
    min_turns: ClassVar[int] = 1

    def corrupt(self, batch, picked, rng, step):
        lr = batch.logp_rollout.copy()
        records = _records(batch)
        counts = batch.turns.turn_counts(batch.cu_seqlens)
        for i in picked.tolist():
            k = int(rng.integers(0, counts[i]))
            start, stop = _turn_span(batch, i, k)
            n = max(int(np.ceil(self.frac * (stop - start))), min(4, stop - start))
            lr[stop - n:stop] = 0.0
            rec = records[i]
            if rec is not None and rec.logprob_counts is not None:
                counts_left = list(rec.logprob_counts)
                counts_left[k] -= n
                records[i] = dataclasses.replace(rec, logprob_counts=tuple(counts_left))
        return _with(batch, records if batch.turns.records is not None else None, logp_rollout=lr)


@dataclass(frozen=True)
class StaleTurn(TurnFault):
    """An async loop served the first turns of a trajectory with weights `lag` versions older than the rest
    (a sync mid-episode, slime #1781): those turns' versions are old and their mismatch larger. Shape: the
    turns before the version change off, the later ones clean; per-turn versions past the allowed lag."""

    name = "stale-turn"
    cause = "stale_turn_weights"
    shape = "the turns before a version change off; their versions old"
    lag: int = 2
    scale: float = 0.05

    def corrupt(self, batch, picked, rng, step):
        lr = batch.logp_rollout.copy()
        records = _records(batch)
        counts = batch.turns.turn_counts(batch.cu_seqlens)
        for i in picked.tolist():
            j = int(rng.integers(1, counts[i]))  # turns 0..j-1 are stale
            start, _ = _turn_span(batch, i, 0)
            _, stop = _turn_span(batch, i, j - 1)
            lr[start:stop] = np.where(batch.turns.tool[start:stop], lr[start:stop],
                                      _perturb(rng, lr[start:stop], self.scale))
            rec = records[i] or TurnRecord()
            base = int(batch.weight_version[i]) if batch.weight_version is not None else step
            versions = list(rec.versions) if rec.versions is not None else [base] * int(counts[i])
            newest = max(max(versions), self.lag)
            records[i] = dataclasses.replace(rec, versions=tuple(newest - self.lag if k < j else v
                                                                 for k, v in enumerate(versions)))
        return _with(batch, records, logp_rollout=lr)


TURN_FAULTS = (RetokenizedHistory, StrippedHistory, MissingGenerationPrompt, JoinTokenMask, ToolTokensInLoss,
               TurnLogprobsMissing, StaleTurn)
