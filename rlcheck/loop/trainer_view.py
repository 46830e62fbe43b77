"""What the trainer scores in the loop, and the step's evidence of it.

    view = trainer_view(cfg.fault, step, seqs, rollouts, tokenizer)   # the engine's ids, or a fault's
    logp_train, topk, routing = recompute(group, view.seqs, plan, view.rollouts(rollouts), top_k)
    batch = view.step_batch(rollouts, logp_train, topk, routing)      # the trainer's side by position
    alarms = prompt_alarms(step, batch)                               # the two sides' prompt ids differ
    group.train_step(view.update_inputs(adv, logp_train, weights, loss_tokens), plan)
    keep_first_alarm(monitor, report, batch)                          # its dump, when it does not halt

The trainer scores the engine's token ids unless the fault gives it others (`Fault.trainer_inputs`:
re-tokenized text, BOS twice, left padding it attends to, no stop token). Its logprobs are laid
against the engine's response tokens by position, as a trainer's padded batch would be compared: a
trainer response shorter than the engine's leaves the engine's last tokens with logprob 0 and the pad
id, a longer one is cut. The batch carries the trainer's prompt ids (`PROMPT_TOKENS_TRAIN`) and the
ids it scored (`tokens_train`); the update trains on what the trainer scored.

A step whose alarms do not halt the run leaves no dump; the first such step of a run gets one
(reason "first alarm"), so that `rlcheck diagnose` has its sequences to read, and so does a later step
whose alarm names a rule (kind and metric) no earlier dump's did ("new alarm"), up to `ALARM_DUMPS` a run:
an early, faint alarm's dump may hold too little of a fault that a later gate sees whole (the random
Llama's stale prefix warned at 2x the trainer's measure with its prefix rows 2.9x the others, at the
clipped-mean gate four steps later far past them; BENCHMARKS.md, "The engine over the trainer's measure").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
from rlcheck.engines.vllm import to_step_batch
from rlcheck.trainers import Sequences


@dataclass(frozen=True)
class TrainerView:
    seqs: Sequences
    """What the trainer scores and trains on (padding included)."""
    prompts: tuple[tuple[int, ...], ...]
    """The trainer's prompt ids, as it reports them (its padding left out)."""
    touched: tuple[int, ...] = ()
    """Sequences whose trainer inputs differ from the engine's."""
    pad_id: int = 0

    @property
    def responses(self) -> tuple[tuple[int, ...], ...]:
        return self.seqs.responses

    def same_lengths(self, rollouts: Sequence[Any]) -> bool:
        return all(len(r) == len(x.token_ids) for r, x in zip(self.responses, rollouts, strict=True))

    def rollouts(self, rollouts: Sequence[Any]) -> list[Any]:
        """The rollouts the recompute reads (MoE experts dropped where the lengths differ: they would not line up)."""
        if self.same_lengths(rollouts):
            return list(rollouts)
        return [dataclasses.replace(r, experts=None) for r in rollouts]

    def step_batch(self, rollouts: Sequence[Any], logp_train: Sequence[np.ndarray], topk: Any = None, routing: Any = None):
        """The monitor's `StepBatch`: the trainer's logprobs and ids laid against the engine's tokens."""
        lengths = [len(r.token_ids) for r in rollouts]
        batch = to_step_batch(
            rollouts, [fit(x, n, 0.0) for x, n in zip(logp_train, lengths, strict=True)],
            tokens_train=[fit(np.asarray(r, dtype=np.int64), n, self.pad_id) for r, n in zip(self.responses, lengths, strict=True)],
            topk=topk, routing=routing)
        return dataclasses.replace(batch, meta={**batch.meta, PROMPT_TOKENS_TRAIN: [list(p) for p in self.prompts]})

    def touched_ids(self, rollouts: Sequence[Any]) -> list[str]:
        return [rollouts[i].request_id for i in self.touched]

    def update_inputs(self, advantages: Any, logp_train: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None,
                      loss_tokens: int | None) -> Sequences:
        """The update's sequences: what the trainer scored, its own logprobs as the old policy's, the
        loss weights (one per engine token) laid on its tokens by position (0 past the engine's)."""
        if weights is not None:
            weights = [fit(np.asarray(w, dtype=np.float32), len(r), 0.0) for w, r in zip(weights, self.responses, strict=True)]
        return self.seqs.with_update_inputs(advantages, logp_train, weights, loss_tokens)


def fit(values: np.ndarray, n: int, fill: float | int) -> np.ndarray:
    """`values` cut or padded with `fill` to length `n` (its dtype kept)."""
    values = np.asarray(values)
    if values.shape[0] >= n:
        return values[:n]
    return np.concatenate([values, np.full(n - values.shape[0], fill, dtype=values.dtype)])


def trainer_view(fault: Any, step: int, seqs: Sequences, rollouts: Sequence[Any], tokenizer: Any) -> TrainerView:
    """The trainer's inputs for this step: the engine's `seqs`, or what `fault.trainer_inputs` makes of them."""
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0
    prompts, responses = [list(p) for p in seqs.prompts], [list(r) for r in seqs.responses]
    given = fault.trainer_inputs(step, prompts, responses, [r.text for r in rollouts], tokenizer)
    if given is None:
        return TrainerView(seqs, seqs.prompts, (), pad)
    pads = given.left_pad or [0] * len(seqs)
    scored = Sequences.build([[pad] * k + list(p) for p, k in zip(given.prompts, pads, strict=True)], given.responses)
    touched = tuple(i for i in range(len(seqs))
                    if scored.prompts[i] != seqs.prompts[i] or scored.responses[i] != seqs.responses[i])
    return TrainerView(scored, tuple(tuple(p) for p in given.prompts), touched, pad)


ALARM_DUMPS = 4
"""The most dumps a run's alarms that do not halt leave (its halt dumps besides)."""


def keep_first_alarm(monitor: Any, report: Any, batch: Any) -> None:
    """Dump the step when it raised an alarm, did not halt, and either the run has no dump yet or an alarm names a
    rule (kind, metric) that no earlier dump's alarms named, while the run has fewer than `ALARM_DUMPS`."""
    if not report.alarms or report.halted:
        return
    dumps = sorted((Path(monitor.run_dir) / "dumps").glob("step_*/meta.json"))
    if not dumps:
        monitor.dump(report.step, batch, report, reason="first alarm")
        return
    if len(dumps) >= ALARM_DUMPS:
        return
    metas = [monitor.run.dump_meta(meta.parent) for meta in dumps]  # each read once a run (`Run.dump_meta`)
    seen = {(a.get("kind"), a.get("metric")) for meta in metas for a in meta.get("alarms") or () if isinstance(a, dict)}
    if any((a.kind, a.metric) not in seen for a in report.alarms):
        monitor.dump(report.step, batch, report, reason="new alarm")
