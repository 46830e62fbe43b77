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
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.queries import MAX_IDS, alarm_steps, alarms_of, metric_series

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
        return _from_invariants(invariants)
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


def _from_invariants(alarms: list[dict]) -> Finding:
    by = _by_signature(alarms)
    if "stale_turn" in by:
        return _finding("stale_turn_weights", 0.99, by["stale_turn"], LEADS["stale_turn_weights"])
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
