"""Re-tokenized or stripped history, told apart from the trained ids alone, for a framework that keeps no
per-call prompts (verl's agent loop, OpenRLHF's action ranges, any turns read from the loss mask).

Both leave one shape in the numbers: the turns from the second on scored on another context than the
engine's, turn 0 clean. The trained ids (a dump's `prompt_tokens` + `response_tokens`, its `turn_index`)
still say which of the two could have happened to each sequence:

- re-tokenizing (decoding the history to text, encoding it again) changes only a history whose ids are not
  the tokenizer's own encoding of their text: where the history before a sequence's first diverged turn
  encodes back to itself, the engine was prefilled with the trainer's ids, and re-tokenization cannot have
  moved that turn;
- stripping needs something to strip: a reasoning block (`REASONING_TAGS`) in the history.

Over the sequences of the alarmed steps' dumps whose first divergence lies in a turn >= 1, with the run's
tokenizer (meta.json's context `model`, a local directory): every one of them (`RETOKENIZED_SHARE`) with a
non-canonical history is re-tokenized history; few (`STRIPPED_SHARE`) with one, most of them holding a
reasoning block, is stripped history. Anything else (no dump, a redacted one, no tokenizer, too few
sequences, a mixed picture) tells nothing and diagnose keeps saying it cannot tell.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.forensics.diagnose.evidence import Evidence

REASONING_TAGS = ("<think>", "</think>")
"""Text that opens or closes a reasoning block, which chat templates strip from earlier turns."""
RETOKENIZED_SHARE = 0.9
"""Re-tokenization can move a turn only after a non-canonical history: all of the diverged sequences hold one
(some slack for a sequence diverged for another reason)."""
STRIPPED_SHARE = 0.5
"""At most this share of non-canonical histories, and a reasoning block in most: not re-tokenization."""
MIN_SEQUENCES = 3
"""Fewer diverged sequences than this tell nothing."""


@dataclass
class HistoryVerdict:
    cause: str
    """"retokenized_history" or "stripped_history"."""
    evidence: list[str]


def history_cause(ev: Evidence, steps: list[int], tokenizer: Any | None = None) -> HistoryVerdict | None:
    """Which of re-tokenized or stripped history the trained ids of the alarmed `steps` allow (module
    docstring); None when they do not tell. `tokenizer`: the run's, else loaded from its context."""
    histories = [h for s in steps for h in _diverged_histories(ev.dump_rows.get(s) or [])]
    if len(histories) < MIN_SEQUENCES:
        return None
    tok = tokenizer if tokenizer is not None else load_tokenizer(ev)
    if tok is None:
        return None
    texts = [tok.decode(ids) for ids in histories]
    altered = np.array([tok.encode(t, add_special_tokens=False) != ids for t, ids in zip(texts, histories, strict=True)])
    reasoning = np.array([any(tag in t for tag in REASONING_TAGS) for t in texts])
    n, share = len(histories), float(altered.mean())
    said = (f"{int(altered.sum())} of the {n} sequences whose turns >= 1 diverged first have a history the tokenizer "
            f"encodes otherwise (decoded, encoded again); {int(reasoning.sum())} hold a reasoning block in it")
    if share >= RETOKENIZED_SHARE:
        return HistoryVerdict("retokenized_history", [said + ": each could have been re-tokenized"])
    if share <= STRIPPED_SHARE and reasoning.mean() > 0.5:
        return HistoryVerdict("stripped_history", [said + ": re-tokenizing leaves a canonical history as it is, so "
                                                   "the engine's context lost something else: the reasoning block"])
    return None


def _diverged_histories(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Per sequence whose first divergence is in a turn >= 1: its trained ids before that turn."""
    out = []
    for row in rows:
        turn, index = row.get("first_divergence_turn"), row.get("turn_index")
        prompt, response = row.get("prompt_tokens"), row.get("response_tokens")
        if turn is None or turn < 1 or index is None or prompt is None or response is None:
            continue
        start = np.flatnonzero(np.asarray(index) == turn)
        if start.size:
            out.append([int(t) for t in np.concatenate([np.asarray(prompt), np.asarray(response)[: start[0]]])])
    return out


def load_tokenizer(ev: Evidence) -> Any | None:
    """The run's tokenizer from its context's `model` (a local directory), or None."""
    model = ((ev.meta() or {}).get("context") or {}).get("model")
    if not model or not Path(model).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer to read: the ids tell nothing
        return None
