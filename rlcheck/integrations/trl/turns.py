"""TRL's multi-turn generations (`GRPOTrainer(tools=...)` / `environment_factory`, TRL 1.16): the turns of
each row, and what vLLM was given at each call, for rlcheck's per-turn statistics and invariants.

TRL keeps no turn boundaries: `_tool_call_loop` builds each next prompt token-in/token-out (prompt +
completion + `_get_tool_suffix_ids`), generates one more completion per row that made a tool call,
and returns one flat completion per row with `tool_mask` 0 on the tool's suffix ids (their logprobs
0.0). The turns are the runs of 1 in `completion_mask * tool_mask` (`StepBatch.with_turns("mask_runs")`).
What vLLM prefilled at each call is known only at the call: `TurnRecorder` wraps the trainer's
`_generate_single_turn`, records each call's prompt ids, sampled ids and logprob counts in order, and
lays them onto the rows afterwards: call 0 holds every row; call c >= 1 the rows with more than c
turns, ascending (the order of TRL's `idxs_with_tool`). The record keeps what vLLM sampled, whatever
the row's ids hold there (the invariants compare them). A generation whose calls do not match the
rows' runs (a tool result rolled back as overlong, a fully truncated turn) keeps its mask runs
without records.

The fire drill (`TRLOptions(inject="retokenized-history")`): from its start step, the prompts of the
tool loop's calls are re-tokenized in place (decoded to text, encoded again: TRL before #5224 rendered
the conversation again), so vLLM prefills other ids than prompt + completion + suffix wherever a
sampled tokenization was not the canonical one; TRL's completion ids are built from those prompts,
as they were then.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rlcheck.core.turns import TurnRecord
from rlcheck.errors import ConfigError
from rlcheck.faults import Fault, RetokenizedHistory, TurnFault

TOOL_FAULTS = (RetokenizedHistory,)
"""The multi-turn faults TRL's tool loop can be given (the others need the own loop)."""


def check_turn_fault(fault: Fault, trainer: Any | None = None) -> None:
    """ConfigError for a multi-turn fault TRL cannot inject, or one without tools to act on."""
    if not isinstance(fault, TurnFault):
        return
    if not isinstance(fault, TOOL_FAULTS):
        raise ConfigError(f"fault {fault.name!r} needs the own loop's episodes (rlcheck demo --task calculator); with "
                          f"TRL rlcheck injects {', '.join(f.name for f in TOOL_FAULTS)} into the tool loop")
    if trainer is not None and not getattr(trainer, "tools", None):
        raise ConfigError(f"fault {fault.name!r} acts on TRL's tool-calling loop: build the GRPOTrainer with tools= "
                          "or environment_factory=")


def recorder_for(trainer: Any, fault: Fault) -> TurnRecorder | None:
    """A `TurnRecorder` on a trainer with tools (None without: one call per row); ConfigError for a
    multi-turn fault TRL cannot inject (`check_turn_fault`)."""
    check_turn_fault(fault, trainer)
    return TurnRecorder(trainer, fault) if getattr(trainer, "tools", None) else None


class TurnRecorder:
    """Records the engine calls of one generation (module docstring); `records(output)` lays them on rows."""

    def __init__(self, trainer: Any, fault: Fault | None = None):
        self.trainer, self.fault = trainer, fault
        self.calls: list[tuple[list[list[int]], list[list[int]], list[int]]] = []
        original = trainer._generate_single_turn
        trainer._generate_single_turn = functools.partial(self._call, original)

    def _call(self, generate: Any, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        if num_generations != 1:  # a generation's first call (G samples per prompt); the tool loop asks 1
            self.calls = []
        if self.calls and isinstance(self.fault, RetokenizedHistory) and self.fault.active(self.trainer.state.global_step):
            tok = self.trainer._tokenizer
            for ids in prompt_ids:  # in place: TRL builds the completion ids from these lists
                ids[:] = tok.encode(tok.decode(ids), add_special_tokens=False)
        completion_ids, logprobs = generate(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        counts = [len(x) for x in logprobs] if logprobs is not None else [len(c) for c in completion_ids]
        self.calls.append(([list(p) for p in prompt_ids], [list(c) for c in completion_ids], counts))
        return completion_ids, logprobs

    def records(self, mask: np.ndarray, version: int | None = None) -> list[TurnRecord | None]:
        """One `TurnRecord` per row (B rows of the padded (B, C) model-token `mask`), or None where the
        calls do not lay onto the row."""
        runs = [_runs(row) for row in np.asarray(mask, dtype=bool)]
        prompts: list[list[list[int]]] = [[] for _ in runs]
        outputs: list[list[list[int]]] = [[] for _ in runs]
        counts: list[list[int]] = [[] for _ in runs]
        if not self.calls or len(self.calls[0][0]) != len(runs):
            return [None] * len(runs)
        for c, (call_prompts, call_outputs, call_counts) in enumerate(self.calls):
            rows = [b for b, r in enumerate(runs) if len(r) > c]
            if len(rows) != len(call_prompts):
                return [None] * len(runs)
            for b, p, o, n in zip(rows, call_prompts, call_outputs, call_counts, strict=True):
                prompts[b].append(p)
                outputs[b].append(o)
                counts[b].append(n)
        return [TurnRecord(prompts[b], outputs[b], counts[b], None if version is None else [version] * len(r),
                           num_turns=len(r)) if r and len(outputs[b]) == len(r) else None for b, r in enumerate(runs)]


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a (C,) bool row."""
    padded = np.concatenate([[False], row, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def with_turns(hook: Any, output: dict[str, Any], batch: Any) -> Any:
    """The step's batch with its turns (the runs of 1 in the loss mask) and, per row, what vLLM was given
    at each call (`hook.turns`, a `TurnRecorder`); the batch as it is for a trainer without tools."""
    if hook.turns is None:
        return batch
    from rlcheck.integrations.trl.batch import response_mask

    version = hook.sync.synced_step
    records = hook.turns.records(response_mask(output), version)
    return batch.with_turns("mask_runs", records=records)
