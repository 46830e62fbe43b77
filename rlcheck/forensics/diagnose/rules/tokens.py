"""Diagnose rules that read the two sides' token ids in a dump (`rlcheck.forensics.diagnose.rows`):

- `prompt_mismatch`: the trainer's prompt ids (`prompt_tokens_train`) are not the engine's; what
  differs (BOS twice, tokens added in front, another tokenization) is said;
- `retokenization`: the trainer's response ids part from the engine's at a later token of some
  sequences (another tokenization of the same text), not from the first token of all of them as an
  off-by-one read does; the rest identical;
- `stop_token`: the ids differ at the last token only, where the engine has the same id in every such
  sequence (the stop token), or, without the trainer's ids, |d| sits on the last token of the sequences
  that end with the most common last id.

A shift by one (off-by-one) stays `token_misalignment` (`diagnose._misalignment`). Confidences are above
its 0.95: the ids at hand say more than the step's token-mismatch count.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from rlcheck.core.prompt_ids import SIGNATURE
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.floors import floor_level
from rlcheck.forensics.diagnose.queries import MAX_IDS, alarm_steps, alarms_of
from rlcheck.forensics.diagnose.rows import (
    CLEAN,
    CONTRAST,
    abs_diff,
    dumped_rows,
    first_difference,
    ids,
    read_over,
    shift_direction,
    token_pattern,
    trainer_prompts,
    values_fit_shift,
)


def prompt_mismatch(ev: Evidence) -> Finding | None:
    """The trainer conditioned the responses on other prompt ids than the engine did."""
    for step, rows in dumped_rows(ev):
        theirs = trainer_prompts(rows)
        if theirs is None:
            continue
        differ = [i for i, p in enumerate(theirs) if not np.array_equal(p, ids(rows[i], "prompt_tokens"))]
        if differ:
            return _prompt_finding(ev, step, rows, theirs, differ)
    logged = alarms_of(ev, kind="signature", signatures=(SIGNATURE,))
    if logged:
        return Finding("prompt_mismatch", 0.9, [f"step {logged[0]['step']}: {logged[0]['message']}"],
                       alarm_steps(logged), list(logged[0]["details"].get("request_ids", []))[:MAX_IDS])
    return None


def _prompt_finding(ev: Evidence, step: int, rows, theirs, differ: list[int]) -> Finding:
    i = differ[0]
    engine, trainer = ids(rows[i], "prompt_tokens"), theirs[i]
    how = describe_prompt_difference(engine, trainer)
    off = np.array([float(abs_diff(rows[j]).mean()) if len(rows[j]["logp_rollout"]) else 0.0 for j in differ])
    evidence = [f"step {step}: {len(differ)} of {len(rows)} sequences were scored by the trainer after other prompt "
                f"ids than the engine's; e.g. {rows[i]['request_id']}: {how}",
                f"engine {engine[:8].tolist()}... ({engine.size} ids), trainer {trainer[:8].tolist()}... "
                f"({trainer.size} ids); {_responses([rows[j] for j in differ])}, their mean |d| is {off.mean():.3g}"]
    steps = sorted({step, *alarm_steps(alarms_of(ev, kind="signature", signatures=(SIGNATURE,)))})
    return Finding("prompt_mismatch", 0.97, evidence, steps, [rows[j]["request_id"] for j in differ][:MAX_IDS])


def _responses(rows: list[dict[str, Any]]) -> str:
    """What the two sides' response ids of `rows` do, as read from the rows (never assumed)."""
    scored = [row for row in rows if ids(row, "tokens_train") is not None and ids(row, "response_tokens") is not None]
    if not scored:
        return "the trainer's response ids are not in the dump"
    differ = sum(not np.array_equal(ids(row, "tokens_train"), ids(row, "response_tokens")) for row in scored)
    if differ:
        return f"the response ids differ on {differ} of them too"
    return "the response ids agree" + (f" (on the {len(scored)} with the trainer's ids)" if len(scored) < len(rows) else "")


def describe_prompt_difference(engine: np.ndarray, trainer: np.ndarray) -> str:
    """In words: the trainer's prompt as the engine's with tokens added in front (BOS twice), or where they part."""
    n = min(engine.size, trainer.size)
    diff = np.flatnonzero(engine[:n] != trainer[:n])
    common = int(diff[0]) if diff.size else n
    extra = trainer.size - engine.size
    if extra > 0 and np.array_equal(trainer[extra:], engine):
        added = trainer[:extra].tolist()
        twice = engine.size and added == [int(engine[0])] * extra
        return (f"the trainer's prompt is the engine's with {added} in front"
                + (f": its first token (BOS) {extra + 1} times" if twice else ""))
    return f"the prompts agree on their first {common} ids, then part ({engine.size} vs {trainer.size} ids)"


def _mismatched(ev: Evidence) -> tuple[int, list[dict[str, Any]], list[str | None]] | None:
    """The first dump whose rows carry both sides' response ids and differ somewhere: (step, rows, patterns)."""
    for step, rows in dumped_rows(ev):
        patterns = [token_pattern(row) for row in rows]
        if any(p is not None for p in patterns):
            return step, rows, patterns
    return None


def retokenization(ev: Evidence) -> Finding | None:
    """Some sequences' trainer ids part from the engine's mid-sequence, not as a shift; the rest identical."""
    found = _mismatched(ev)
    if found is None:
        return None
    step, rows, patterns = found
    parted = [i for i, p in enumerate(patterns) if p == "from"]
    shifted = [i for i, p in enumerate(patterns) if p == "shift"]
    if not parted or len(shifted) > len(parted):
        return _moved_but_not_misread(step, rows, shifted, parted)
    where = np.array([first_difference(rows[i]) for i in parted])
    i = parted[0]
    t = int(where[0])
    engine, trainer = ids(rows[i], "response_tokens"), ids(rows[i], "tokens_train")
    same = sum(p is None for p in patterns)
    evidence = [f"step {step}: {len(parted)} of {len(rows)} sequences: the trainer's response ids equal the engine's up "
                f"to a token (median position {int(np.median(where))}, {int((where > 0).sum())} of them past the first), "
                f"then differ; {same} sequences identical",
                f"e.g. {rows[i]['request_id']} at position {t}: engine {engine[t:t + 4].tolist()}, trainer "
                f"{trainer[t:t + 4].tolist()}: the ids part mid-sequence, in some sequences only, not from the first "
                "token of every one as a read one token late does: the trainer re-tokenized the decoded text "
                "(multi-turn, tool loops); use the engine's token ids"]
    return Finding("retokenization", 0.97, evidence, [step], [rows[j]["request_id"] for j in parted][:MAX_IDS])


def _moved_but_not_misread(step: int, rows, shifted: list[int], parted: list[int]) -> Finding | None:
    """The trainer's ids are the engine's moved by one token, as an off-by-one's are, but its logprobs
    follow no shift (`values_fit_shift` False on at least half the moved rows, True on none): it scored
    another sequence, one token shorter or longer, in another context (the decoded text re-tokenized
    without a token the sampler emitted), not the engine's sequence read one token over. `parted`: the
    rows whose ids part later (another tokenization), said beside them."""
    fits = [values_fit_shift(rows[i]) for i in shifted]
    moved = [i for i, fit in zip(shifted, fits, strict=True) if fit is False]
    if not moved or True in fits or len(moved) < len(shifted) / 2:
        return None
    i = moved[0]
    engine, trainer = ids(rows[i], "response_tokens"), ids(rows[i], "tokens_train")
    late = shift_direction(engine, trainer, first_difference(rows[i])) == "late"
    where = Counter(int(ids(rows[j], "response_tokens")[first_difference(rows[j])]) for j in moved)
    token, count = where.most_common(1)[0]
    straight = float(np.mean([abs_diff(rows[j]).mean() for j in moved]))
    over = float(np.mean([read_over(rows[j]).mean() for j in moved]))
    how = (f"without the engine's id {token} where they part ({count} of them)" if late
           else f"with an id in front where they part (the engine's {token} there in {count} of them)")
    evidence = [f"step {step}: {len(moved)} of {len(rows)} sequences: the trainer's response ids are the engine's moved "
                f"by one token, {how}; e.g. {rows[i]['request_id']}: engine {engine[:5].tolist()}, trainer "
                f"{trainer[:5].tolist()}" + (f"; {len(parted)} more part later" if parted else ""),
                f"but the trainer's logprobs follow no shift: mean |d| {straight:.3g} as aligned, {over:.3g} read one "
                "token over (where a read one token late fits near the noise): the trainer scored another sequence, "
                "not the engine's read one token late: the decoded text re-tokenized drops or adds a token the "
                "sampler emitted (a special token the text leaves out, a merge); use the engine's token ids"]
    return Finding("retokenization", RETOKENIZED_SHIFT, evidence, [step], [rows[j]["request_id"] for j in moved + parted][:MAX_IDS])


RETOKENIZED_SHIFT = 0.9
"""Confidence of a retokenization read from ids moved by one whose logprobs follow no shift: above the
token-id signature alone (`token_misalignment` 0.85), under it with the shift signature too (0.95)."""


def stop_token(ev: Evidence) -> Finding | None:
    """The mismatch sits on the last token of the sequences that end with the stop token."""
    found = _mismatched(ev)
    if found is not None:
        step, rows, patterns = found
        last = [i for i, p in enumerate(patterns) if p == "last"]
        if last and len(last) >= 0.9 * sum(p is not None for p in patterns):
            return _stop_by_ids(step, rows, last)
        return None
    return _stop_by_logprobs(ev)


def _stop_by_ids(step: int, rows, last: list[int]) -> Finding:
    ends = Counter(int(ids(rows[i], "response_tokens")[-1]) for i in last)
    stop, count = ends.most_common(1)[0]
    ending = [i for i, row in enumerate(rows) if len(row["response_tokens"]) and int(row["response_tokens"][-1]) == stop]
    other = [i for i in range(len(rows)) if i not in set(ending)]
    scored = sorted({int(ids(rows[i], "tokens_train")[-1]) for i in last})
    evidence = [f"step {step}: the two sides' ids differ at the last token only, on {len(last)} of {len(rows)} sequences; "
                f"there the engine has token {stop} in {count} of them (the stop token), the trainer {scored[:3]}",
                f"{len(ending)} sequences end with token {stop}; the {len(other)} others (cut at the length limit) and "
                "every earlier token match: the stop token is scored on one side and dropped or aligned otherwise on "
                "the other (mask it on both, or score it on both)"]
    return Finding("stop_token", 0.97, evidence, [step], [rows[i]["request_id"] for i in last][:MAX_IDS])


def _stop_by_logprobs(ev: Evidence) -> Finding | None:
    """Without the trainer's ids (a dump whose rows have no `tokens_train`): the last token of the rows
    ending with the most common last id carries the |d|, every other token is clean."""
    anomalous = set(alarm_steps(alarms_of(ev)))
    for step, rows in dumped_rows(ev):
        if step not in anomalous or any(row.get("tokens_train") is not None for row in rows) or not all(
                len(row["logp_rollout"]) >= 2 and row.get("response_tokens") is not None for row in rows):
            continue  # with the trainer's ids at hand, `_stop_by_ids` has said all there is
        ends = Counter(int(row["response_tokens"][-1]) for row in rows)
        stop, count = ends.most_common(1)[0]
        if count < max(2, 0.2 * len(rows)):
            continue
        tails = np.array([abs_diff(row)[-1] for row in rows if int(row["response_tokens"][-1]) == stop])
        rest = np.concatenate([abs_diff(row)[:-1] for row in rows])
        # the contrast is with this step's other tokens, floored at the precision's own noise (not 10x it:
        # a bf16 verl run's EOS at 0.45 nats beside 0.01 elsewhere read as 'no known shape')
        floor = max(float(np.mean(rest)), CLEAN, floor_level(ev))
        if tails.mean() <= CONTRAST * floor:
            continue
        zeroed = None if np.median(tails) > CONTRAST * floor else _zeroed_side(rows, stop)
        if np.median(tails) > CONTRAST * floor or zeroed is not None:
            hit = [row["request_id"] for row in rows if int(row["response_tokens"][-1]) == stop]
            return Finding("stop_token", 0.9, [
                f"step {step}: the {count} sequences ending with token {stop} (the most common last token: the stop "
                f"token) are off at that token by {tails.mean():.3g} on average; every other token {np.mean(rest):.2g}",
                *([zeroed] if zeroed else []),
                "the stop token is scored on one side and dropped or aligned otherwise on the other"], [step], hit[:MAX_IDS])
    return None


UNSURE = 0.05
"""|logprob| above which a side was not sure of a token: the other side's exact 0.0 there is no rounding."""


def _zeroed_side(rows, stop: int) -> str | None:
    """Where the stop token's |d| is heavy-tailed (a confident model's EOS barely moves when one side drops
    it: verl's legacy trainer scored without the EOS gives old_log_probs 0.0 there, |d| = the engine's own
    0.002 to 4.8 nats, median 0.049 on one run): the side whose logprob of the stop token is exactly 0.0 on
    at least 9 in 10 of the rows ending with it where the other side was unsure, and on at most 1 in 20 of
    the other unsure tokens, in words; else None."""
    ending = [row for row in rows if int(row["response_tokens"][-1]) == stop]
    for side, key, other in (("trainer", "logp_train", "logp_rollout"), ("engine", "logp_rollout", "logp_train")):
        tail = np.array([float(row[key][-1]) == 0.0 for row in ending if _kept(row)[-1] and abs(float(row[other][-1])) > UNSURE])
        rest = np.concatenate([(np.asarray(row[key], np.float64) == 0.0)[:-1][
            (_kept(row) & (np.abs(np.asarray(row[other], np.float64)) > UNSURE))[:-1]] for row in rows])
        share = float(rest.mean()) if rest.size else 0.0
        if tail.size >= 2 and tail.mean() >= 0.9 and share <= 0.05:
            return (f"the {side}'s logprob of token {stop} is exactly 0.0 on {int(tail.sum())} of the {tail.size} such "
                    f"rows where the other side was unsure of it (|logprob| > {UNSURE}), on {share:.1%} of the other "
                    f"unsure tokens: the {side} never scored it")
    return None


def _kept(row) -> np.ndarray:
    """(L,) the row's compared tokens (its mask, where it has one)."""
    n = len(row["logp_rollout"])
    return np.ones(n, dtype=bool) if row.get("mask") is None else np.asarray(row["mask"], dtype=bool)
