"""The diagnose rule `multiturn`: the causes only agent loops have, from a multi-turn run's evidence.

Direct evidence first: the cross-turn invariants' alarms (`rlcheck.core.turn_checks`, signature
"turn_<invariant>", their breaches in `details["evidence"]`):

| evidence                                                                  | cause                      |
|---------------------------------------------------------------------------|----------------------------|
| a turn's weights version past the allowed lag                             | stale_turn_weights         |
| tokens marked tool / observation in the loss; or zero-logprob runs the    | tool_tokens_in_loss        |
| trainer finds unlikely (mean lp < -2), turns merged (fewer than counted)  |                            |
| the trained ids before turn k lack what the engine had right before it    | missing_generation_prompt  |
| a later call's prompt lacks a run of an earlier output's ids (deleted)    | stripped_history           |
| a later call's prompt holds other ids inside an earlier output            | retokenized_history        |
| a zero-logprob token at a turn's end; a trained turn one token longer     | join_token_mask            |
| zero-logprob runs in sequences whose turns merged (fewer than counted)     | tool_tokens_in_loss        |
| a zero-logprob run inside a turn, the trainer's logprobs ordinary, or in a | turn_logprobs_missing      |
| turn >= 80% exactly 0.0 (sure tokens too); fewer logprobs than sampled ids |                            |

Without invariant alarms (a framework that keeps no per-call prompts), the shape of the alarmed steps'
per-turn statistics (`rlcheck/turn/*`): the turns' heads far above their bodies is a missing generation
prompt; turns >= 1 far above turn 0 is history the engine saw otherwise than the trainer (re-tokenized or
stripped: without the engine's prompts the two cannot be told apart, and the finding says so). These
outrank `position_dependent` (0.9): later turns sit at later positions, but a mismatch that grows with the
position raises turn 0's own tail too, where these leave turn 0 clean (the ratios are against it).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.stats import StatsConfig
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.queries import MAX_IDS, alarm_steps, alarms_of, metric_series
from rlcheck.forensics.diagnose.rows import abs_diff

TOOL_LOGPROB = -2.0
"""A zero-logprob run whose trainer logprobs average below this is text the model did not write."""
WHOLE_TURN_ZEROS = 0.8
"""A zero-logprob run in a model turn whose compared tokens are at least this share exactly 0.0 (the sure ones
counted too) is a turn's logprobs filled in, whatever the trainer thinks of the tokens: a healthy fp32 engine
gives 0.0 to ~11% of the calculator model's tokens, scattered; a tool reply merged into a turn adds its share."""
HEAD_RATIO, LATER_RATIO = 4.0, 2.0
"""The alarmed steps' median head/body and later/turn-0 ratios that name a cause from the shape alone."""


def multiturn(ev: Evidence) -> Finding | None:
    """The multi-turn cause of the run's alarms, or None when they are not about turns."""
    invariants = [a for a in alarms_of(ev, kind="signature")
                  if str(a["details"].get("signature", "")).startswith("turn_")]
    if invariants:
        return _from_invariants(ev, invariants)
    history = _rewritten_history(ev, [])
    if history is not None:
        return history
    shaped = [a for a in alarms_of(ev) if str(a.get("metric", "")).startswith(K.TURN_PREFIX)]
    return _from_shape(ev, shaped) if shaped else None


def _by_signature(alarms: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for a in alarms:
        out.setdefault(a["details"]["signature"].removeprefix("turn_"), []).append(a)
    return out


def _finding(cause: str, confidence: float, alarms: list[dict], lead: str) -> Finding:
    ids = list(dict.fromkeys(r for a in alarms for r in a["details"].get("request_ids", [])))[:MAX_IDS]
    steps = alarm_steps(alarms)
    evidence = [lead, f"step {alarms[0]['step']}: {alarms[0]['message']}", f"on {len(steps)} step(s), first {steps[0]}"]
    return Finding(cause, confidence, evidence, steps, ids)


def _breaches(alarms: list[dict]) -> list[dict]:
    return [e for a in alarms for e in a["details"].get("evidence", [])]


def prefix_cause(e: dict) -> str:
    """The cause one prefix break points at (see the module docstring)."""
    if e.get("check", "").startswith("equals") and e.get("in") == "output" and e.get("turn") == e.get("call") \
            and e.get("offset") == 0:
        return "missing_generation_prompt"
    if (e.get("edit") or {}).get("kind") == "deleted":
        return "stripped_history"
    return "retokenized_history"


def zero_cause(e: dict) -> str:
    """The cause one zero-logprob or count breach points at."""
    if "trainer_mean_logprob" in e:
        if (e.get("turn_zero_share") or 0.0) >= WHOLE_TURN_ZEROS:  # a whole turn filled with 0.0, sure tokens too
            return "turn_logprobs_missing"
        if e["trainer_mean_logprob"] < TOOL_LOGPROB and e.get("length", 0) >= 2:
            return "tool_tokens_in_loss"
        return "join_token_mask" if e.get("at_turn_end") and e.get("length", 0) <= 2 else "turn_logprobs_missing"
    sampled, trained, count = e.get("sampled"), e.get("trained_tokens"), e.get("logprobs")
    if sampled is not None and trained is not None and abs(trained - sampled) == 1 and count == sampled:
        return "join_token_mask"
    return "turn_logprobs_missing"


LEADS = {
    "stale_turn_weights": "turns of one trajectory came from weights older than the allowed lag (per-turn versions)",
    "tool_tokens_in_loss": "tool / observation tokens are compared and trained on, with an engine logprob of 0.0",
    "missing_generation_prompt": "the trainer's ids before each later turn lack the generation prompt the engine had",
    "stripped_history": "later calls' prompts lack part of an earlier turn's output (the template stripped it)",
    "retokenized_history": "later calls' prompts hold another tokenization of an earlier turn's output",
    "join_token_mask": "the token the framework puts after a turn is in the loss, with a made-up logprob of 0.0",
    "turn_logprobs_missing": "a turn's engine logprobs are missing, filled with 0.0",
}


MERGED_ZEROS = ("fewer turns found in the loss mask than the framework counts, and engine logprobs of exactly 0.0 "
                "inside the merged turns: the tool replies between the turns are in the loss mask")
"""The lead when the zero-logprob runs sit in sequences whose turns merged (verl's real trainer with its
tool replies put in the loss: the trained calculator model finds some replies likely, mean logprob -1.15
over a 4-token run, so the zeros alone read as a turn's logprobs missing; a turn's logprobs filled with 0.0
merges no turns)."""


def _ids(alarms: list[dict]) -> set[str]:
    return {r for a in alarms for r in a["details"].get("request_ids", [])}


def _from_invariants(ev: Evidence, alarms: list[dict]) -> Finding:
    by = _by_signature(alarms)
    if "stale_turn" in by:
        return _finding("stale_turn_weights", 0.99, by["stale_turn"], LEADS["stale_turn_weights"])
    history = _rewritten_history(ev, alarms) if "prefix_break" not in by else None
    if history is not None:  # every zero-logprob / count breach sits past an earlier divergence of its turn
        return history
    zeros = _breaches(by.get("zero_logprobs", []))
    if "tool_in_loss" in by or any(zero_cause(e) == "tool_tokens_in_loss" for e in zeros):
        return _finding("tool_tokens_in_loss", 0.98, by.get("tool_in_loss") or by["zero_logprobs"],
                        LEADS["tool_tokens_in_loss"])
    if "prefix_break" in by:
        votes = Counter(prefix_cause(e) for e in _breaches(by["prefix_break"]))
        cause = votes.most_common(1)[0][0] if votes else "retokenized_history"
        return _finding(cause, 0.97, by["prefix_break"], LEADS[cause])
    merged = [e for e in _breaches(by.get("turn_count", [])) if e["found"] < e["framework"]]
    if merged and by.get("zero_logprobs") and _ids(by["zero_logprobs"]) <= _ids(by["turn_count"]):
        return _finding("tool_tokens_in_loss", 0.97, by["zero_logprobs"] + by["turn_count"], MERGED_ZEROS)
    counted = _breaches(by.get("zero_logprobs", []) + by.get("logprob_count", []))
    if counted:
        cause = Counter(zero_cause(e) for e in counted).most_common(1)[0][0]
        return _finding(cause, 0.96, by.get("zero_logprobs") or by["logprob_count"], LEADS[cause])
    lead = ("fewer turns found in the loss mask than the framework counts: tool replies masked in merge the turns"
            if merged else "the turns found disagree with the framework's count")
    return _finding("tool_tokens_in_loss" if merged else "join_token_mask", 0.7, by["turn_count"], lead)


def _median_at(ev: Evidence, key: str, steps: list[int]) -> float:
    s, v = metric_series(ev, key)
    on = np.isin(s, steps)
    return float(np.median(v[on])) if on.any() else float("nan")


def _where(ev: Evidence, steps: list[int]) -> str:
    """Where the alarmed steps' worst sequences first diverge (their offenders' turn and offset), in words."""
    for rec in ev.records:
        if rec["step"] in steps:
            hit = next((o for o in rec.get("offenders") or () if o.get("turn") is not None), None)
            if hit is not None:
                return (f"step {rec['step']}: {hit['request_id']} first diverges at turn {hit['turn']}, offset "
                        f"{hit['turn_offset']} (worst turn of the alarmed steps: "
                        f"{_median_at(ev, K.TURN_WORST, steps):.0f}, median)")
    return f"worst turn of the alarmed steps: {_median_at(ev, K.TURN_WORST, steps):.0f} (median)"


def _from_shape(ev: Evidence, alarms: list[dict]) -> Finding | None:
    steps = alarm_steps(alarms)
    head, later = _median_at(ev, K.TURN_HEAD_BODY_RATIO, steps), _median_at(ev, K.TURN_LATER_RATIO, steps)
    if head >= HEAD_RATIO:
        f = _finding("missing_generation_prompt", 0.93, alarms, LEADS["missing_generation_prompt"])
        f.evidence.insert(1, f"the first tokens of turns >= 1 are {head:.1f}x further off than the rest of those turns "
                             "(median over the alarmed steps); turn 0 is not")
        f.evidence.insert(2, _where(ev, steps))
        return f
    if later >= LATER_RATIO:
        f = _finding("retokenized_history", 0.92, alarms, LEADS["retokenized_history"])
        f.evidence.insert(1, f"turns >= 1 are {later:.1f}x further off than turn 0 (median over the alarmed steps), "
                             "their heads no more than the rest: the later turns were generated on another context")
        f.evidence.insert(2, _where(ev, steps))
        f.evidence.append("without the engine's per-call prompt ids (TurnRecord.prompt_ids) re-tokenized history cannot "
                          "be told from history the template stripped (stripped_history): record them to tell")
        return f
    return None


HISTORY_SHARE = 0.8
"""The share of the diverging rows that must show the rewritten-history shape (first off in an earlier turn, the
last turn clean), and of the zero-logprob / count breaches that must sit past such a divergence."""
AT_START, INSIDE = 0.8, 0.2
"""The diverging rows' share first off at their turn's first token that reads as a stripped turn start (at
least AT_START, on at least AT_START of all rows), or as re-tokenized ids inside the text (at most INSIDE)."""
STRIPPED_OR_RETOKENIZED = 0.85
"""Below the invariants' direct evidence (0.96-0.99), above every other rule these runs set off (split twins on a
stateless model 0.6, the sparse shapes' 0.85 on a recurrent one ties and the earlier rule wins)."""
UNTOLD = 0.6


def _rewritten_history(ev: Evidence, alarms: list[dict]) -> Finding | None:
    """A multi-turn batch handed over without the engine's per-call prompts (turns from the loss mask's runs:
    verl's agent loop, OpenRLHF), read from its dumped rows: the trainer scores the conversation as rendered
    last, the engine's logprobs are those of what it generated. An earlier turn rendered otherwise (history
    re-tokenized, or stripped by the template) then puts the rows off in an earlier turn while their last turn,
    generated on the rendered history, is clean; a zero logprob at an earlier turn's end is the engine's
    logprobs laid onto a shorter trained turn, not a join token, when the row is off from before it. Stripped
    (a `<think>` block dropped at the turn's start) puts nearly every row off from a turn's first token;
    re-tokenized (another spelling of the same text) a part of the rows, inside the text. None where the shape
    does not hold, or the per-call prompts were recorded (their invariants say it directly)."""
    if (ev.meta().get("turns") or {}).get("source") != "mask_runs":
        return None
    steps = set(alarm_steps(alarms_of(ev)))
    rows = [(step, row) for step, rs in sorted(ev.dump_rows.items()) if step in steps for row in rs]
    off = [(step, row) for step, row in rows if _finite(row.get("first_divergence_turn"))]
    if not off:
        return None
    tau = StatsConfig().divergence_tau
    shaped = [(step, row) for step, row in off if _earlier_turn_off(row, tau)]
    if len(shaped) < HISTORY_SHARE * len(off):
        return None
    fd = {row["request_id"]: (int(row["first_divergence_turn"]), int(row["first_divergence_turn_offset"]))
          for _, row in off}
    breaches = _breaches(alarms)
    downstream = [e for e in breaches if e.get("request_id") in fd and fd[e["request_id"]] < (e["turn"], e["offset"])]
    if len(downstream) < HISTORY_SHARE * len(breaches):
        return None
    at_start = sum(fd[row["request_id"]][1] == 0 for _, row in off) / len(off)
    turns = Counter(fd[row["request_id"]][0] for _, row in off)
    ids = [row["request_id"] for _, row in shaped][:MAX_IDS]
    first = shaped[0][1]
    evidence = [f"{len(shaped)} of {len(off)} diverging rows ({len(rows)} dumped on the alarmed steps) are off first in "
                f"an earlier turn (by turn: {dict(sorted(turns.items()))}) while their last turn, generated on the "
                "history as the trainer scores it, is clean: the history the trainer scores is not what the engine "
                "generated", f"e.g. {first['request_id']} first diverges at turn {fd[first['request_id']][0]}, offset "
                f"{fd[first['request_id']][1]}"]
    if downstream:
        evidence.append(f"{len(downstream)} zero-logprob / count breach(es) sit past their row's first divergence in "
                        "an earlier turn: the engine's logprobs laid onto a trained turn of another length, not a "
                        "join token")
    tell = ("record each call's prompt ids (TurnRecord.prompt_ids; verl: the agent loop's per-call prompts) and the "
            "prefix invariant names the edit directly: ids deleted (stripped) or spelled otherwise (re-tokenized)")
    if at_start >= AT_START and len(off) >= AT_START * len(rows):
        cause, confidence = "stripped_history", STRIPPED_OR_RETOKENIZED
        evidence.append(f"{at_start:.0%} of the diverging rows, {len(off)} of {len(rows)}, are off from their turn's "
                        "first token: the start of an earlier turn is gone (a chat template dropping its <think>), "
                        "not re-spelled (a re-tokenization moves ids inside the text, in some rows)")
    elif at_start <= INSIDE:
        cause, confidence = "retokenized_history", STRIPPED_OR_RETOKENIZED
        evidence.append(f"{len(off)} of {len(rows)} rows diverge, {1 - at_start:.0%} of them inside a turn's text "
                        "(never or seldom at its first token): the same text spelled in other ids where the model "
                        "sampled a non-canonical tokenization, not a block stripped (which moves every row from the "
                        "turn's start)")
    else:
        cause, confidence = "retokenized_history", UNTOLD
        evidence.append(f"{at_start:.0%} of the diverging rows ({len(off)} of {len(rows)}) are off from their turn's first "
                        "token: between a stripped turn start and ids re-spelled inside the text; without the per-call "
                        "prompts the two cannot be told apart here")
    return Finding(cause, confidence, [LEADS[cause], *evidence, tell], sorted({s for s, _ in shaped}), ids)


def _finite(value) -> bool:
    try:
        return value is not None and np.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _earlier_turn_off(row: dict, tau: float) -> bool:
    """The row is first off in a turn before its last one, and its last turn is within `tau` throughout, the first
    divergence on a logprob the engine gave (not a filled-in 0.0: that is a turn's logprobs missing)."""
    turn = np.asarray(row["turn_index"])
    if not turn.size or int(row["first_divergence_turn"]) >= int(turn.max()):
        return False
    d = abs_diff(row)
    lr = np.asarray(row["logp_rollout"], np.float64)
    start = np.flatnonzero(turn == int(row["first_divergence_turn"]))
    at = start[int(row["first_divergence_turn_offset"])] if int(row["first_divergence_turn_offset"]) < start.size else None
    return bool(d[turn == turn.max()].max(initial=0.0) <= tau and (at is None or lr[at] != 0.0))
