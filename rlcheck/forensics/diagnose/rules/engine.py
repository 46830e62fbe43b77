"""The diagnose rule for an engine whose output is not a function of the request (`engine_state`): the
two Mamba state faults, read from logprobs alone (the engine guard, `rlcheck.engines.guard`, reads
them from the scheduler's slots: `diagnose._engine_guard`).

- The engine scored identical contexts of a step apart (the `split_twins` signature,
  `rlcheck.core.stats.twins`), which neither a weight, a temperature nor a precision does. Stale state
  needs a slot another request held before: a run whose first steps scored their twins alike and
  split them from a later step (the first wave of requests gets never-used slots; the next reuses
  them) is `stale_state`. Split from the run's first step, no slot had a previous holder yet: on a
  quarter of the sequences or more, a state shared between live requests (`index_aliasing`: every
  request past a slot boundary and the ones it aliases); on fewer, a few requests on state not their
  own (`stale_state` at 0.8: an engine that served before the run). Each says what tells them apart.
- A few groups of identical contexts each scored alike by both sides, off from the trainer together (the
  `twins_off` signature, raised on a model with recurrent state only): a stale state read alike by every
  sample of a prompt (the demo's trained hybrid with a bf16 engine on an AVX512-BF16 CPU). After clean
  first steps, `stale_state`; from the run's first step no slot had a previous holder, and a per-prompt
  shift from the start is the position rules' (left padding), so nothing is named from it.
- Every sequence far off from the run's first step (past the hard limit on catastrophic sequences)
  while the engine holds the trainer's weights (the sync check's fingerprints agree) and the two sides
  scored the same ids: the engine computes garbage with the right weights; on a model with recurrent
  state an aliased state index does exactly that (`index_aliasing`, lower confidence, the same
  pointer to the guard and `rlcheck stress`).
- The sync check's probe failing while every fingerprint agrees, on a run whose batches have some of
  their sequences (not all) diverging from their first token: the weights are the trainer's and the
  engine computes otherwise per request, its state, not "weights not synced" (`stale_state` after a
  clean first step, else `index_aliasing`; above the weights rule's probe-only 0.85).

None of these is a state cause on a model known to have no recurrent state (the context's `model_type`,
`Evidence.recurrent`): there split twins say the engine was not given the ids the trainer scored
(`token_misalignment` at 0.6, under any direct finding), and garbage or a probe-only failure is left to
the other rules; a model of unknown type is read as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.floors import LEVELS
from rlcheck.core.stats import StatsConfig
from rlcheck.core.stats.twins import off_twin_sequences, split_twin_sequences
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.floors import floor_level
from rlcheck.forensics.diagnose.queries import (
    MAX_IDS,
    alarm_steps,
    alarms_of,
    catastrophic_ids,
    catastrophic_rows,
    metric_series,
)
from rlcheck.forensics.diagnose.rows import left_padding

TELLS = ("run it again with the engine guard (`rlcheck demo --guard`, `VLLMConfig(guard=GuardConfig())`) or "
         "reproduce it with `rlcheck stress`: both read the scheduler's state slots and tell stale state "
         "(a slot read before its prefill) from aliasing (a slot two live requests share)")
STALE, ALIASED, GARBAGE, PROBE, FEW, STATELESS, ROUTED, OFF = 0.93, 0.75, 0.7, 0.88, 0.8, 0.6, 0.8, 0.9
MANY = 0.25
"""Split from the run's first step: index aliasing when at least this share of the sequences is off (every
request past a slot boundary, and the ones it shares with), stale state for fewer (a few reused slots)."""
SHAPES = ("early_divergence", "sparse_catastrophic", "many_catastrophic")
"""Confidences: a split twin is direct evidence, above the weights rules' probe-only 0.85 and the
sparse shapes' 0.85; below the guard's 0.97, and below the MoE routing rule's 0.9 where the split comes
from the first step (rerouted near-tie tokens split twins too, and their own metrics say so). Garbage
from the first step outranks the sparse shapes' 0.6 for catastrophic sequences that are not early. Groups
off together after clean steps (`OFF`): under split twins (a group off together is a per-prompt shift, which
a wrong position or prompt could make too), above the padded-rows rule's 0.85 that reads the same rows
without the twins."""


def engine_state(ev: Evidence) -> Finding | None:
    split = alarms_of(ev, kind="signature", signatures=("split_twins",))
    if ev.recurrent() is False:  # no state to be stale or aliased: the twins say something else, the rest is not ours
        return _split_stateless(ev, split) if split else None
    if split:
        return _split(ev, split)
    return _off_together(ev) or _garbage(ev) or _probe_state(ev)


def _split_stateless(ev: Evidence, split: list[dict[str, Any]]) -> Finding:
    """Split twins on a model without recurrent state: the engine cannot have read another request's state, so
    the identical trained contexts were not identical where the engine scored them (the trainer's ids are not
    the ones the engine was given: a re-tokenization, a history rendered again) or its kernel varies with the
    batch. Below every direct finding (a multi-turn history cause, the sparse shapes' 0.85). On an MoE model
    judged at the fp32 floor whose routing differed between the sides on those steps, the routing
    (`_split_rerouted`)."""
    steps = alarm_steps(split)
    ids = _split_ids(ev, steps)
    rerouted = _split_rerouted(ev, steps, ids, split[0])
    if rerouted is not None:
        return rerouted
    evidence = [f"step {steps[0]}: {split[0]['message']}",
                f"the model ({ev.model_type()}) has no recurrent state, so no request read another's: the engine was "
                "not given the contexts the trainer scored as identical (the trained ids are not the sampled ids: a "
                "re-tokenization, an agent's history rendered again between turns) or its kernel varies with the "
                "batch; compare the engine's own request ids with the trained ones (a multi-turn loop: record "
                "each call's prompt ids)"]
    return Finding("token_misalignment", STATELESS, evidence, steps, ids)


def _split_rerouted(ev: Evidence, steps: list[int], ids: list[str], first: dict[str, Any]) -> Finding | None:
    """`moe_routing` for split twins on an MoE model whose engine routed some response tokens to other experts than
    the trainer on the split steps, at the fp32 floor: there both sides compute the router within 1e-6 and agree on
    every token of a healthy run (the tiny trained MoE: 8 of 8 steps), so a rerouted token is a routing
    difference, not rounding (under a bf16 engine 0 to 5% of the tokens reroute from rounding alone). The rerouted
    response tokens need not carry the mismatch (`rules.moe`'s test): a prompt token routed otherwise in one
    request's prefill moves its whole response, and the routing record holds the response tokens only
    (`moe-route-flip=0.1`: 1-3% of the response tokens rerouted, carrying 3-90% of a step's |d|)."""
    if floor_level(ev) > LEVELS["float32"]:
        return None
    agree_steps, agree = metric_series(ev, K.MOE_ROUTE_AGREE_FRAC)
    on = np.isin(agree_steps, steps) & (agree < 1.0)
    if not on.any():
        return None
    hit = [int(s) for s in agree_steps[on]]
    evidence = [f"step {steps[0]}: {first['message']}",
                f"the model is an MoE ({ev.model_type()}), both sides at fp32, and on step(s) {', '.join(map(str, hit[:6]))} "
                f"the engine sent up to {1.0 - float(np.min(agree[on])):.1%} of the response tokens to other experts than the "
                "trainer (a healthy fp32 run agrees on every token): requests of one prompt routed otherwise (their "
                "prompt tokens too, which the routing record of the responses does not hold) scored the same "
                "context apart; routing replay (the engine's experts in the trainer) or the router's kernel"]
    return Finding("moe_routing", ROUTED, evidence, sorted(set(steps) | set(hit)), ids)


def _split(ev: Evidence, split: list[dict[str, Any]]) -> Finding:
    shapes = alarms_of(ev, kind="signature", signatures=SHAPES)  # the state faults' other shapes, where twins were few
    steps = alarm_steps(split + shapes)
    first, a = steps[0], split[0]
    clean = [int(r["step"]) for r in ev.records if int(r["step"]) < first]
    ids = list(dict.fromkeys(_split_ids(ev, alarm_steps(split)) + catastrophic_ids(ev, shapes)))[:MAX_IDS]
    evidence = [f"step {first}: {a['message']}",
                f"on {len(steps)} step(s); {len(ids)} request(s) in split groups among the dumped steps"]
    if clean:
        evidence.append(f"the run's first {len(clean)} step(s) (from step {clean[0]}) scored their twins alike: the "
                        f"engine turned inconsistent at step {first}, as when requests first start in state slots "
                        "other requests held before (the first wave of a run gets never-used slots)")
        return Finding("stale_state", STALE, evidence + [TELLS], steps, ids)
    share = _off_share(ev, first, ids)
    if share < MANY:
        evidence.append(f"inconsistent from the run's first step on {share:.0%} of its sequences: a few requests "
                        "computed from state not their own, stale state (an engine that served requests before this "
                        "run) as likely as an aliased index")
        return Finding("stale_state", FEW, evidence + [TELLS], steps, ids)
    evidence.append(f"inconsistent from the run's first step, before any state slot had a previous holder, on {share:.0%} "
                    "of its sequences: a state shared between live requests (an aliased state index, past a boundary "
                    "that more concurrency crosses) is the likelier")
    return Finding("index_aliasing", ALIASED, evidence + [TELLS], steps, ids)


def _off_together(ev: Evidence) -> Finding | None:
    """`stale_state` for groups off together (`twins_off`) after clean first steps."""
    off = alarms_of(ev, kind="signature", signatures=("twins_off",))
    if not off:
        return None
    steps = alarm_steps(off)
    clean = [int(r["step"]) for r in ev.records if int(r["step"]) < steps[0]]
    if not clean:
        return None
    ids = _twin_ids(ev, steps, off_twin_sequences)
    evidence = [f"step {steps[0]}: {off[0]['message']}",
                f"on {len(steps)} step(s); the run's first {len(clean)} step(s) (from step {clean[0]}) had no group "
                f"off: the engine turned per-prompt wrong at step {steps[0]}, as when requests first start in state "
                "slots other requests held before", TELLS]
    return Finding("stale_state", OFF, evidence, steps, ids)


def _off_share(ev: Evidence, step: int, ids: list[str]) -> float:
    """The share of `step`'s sequences off: those named (from its dump), else the flagged share of its record."""
    rows = ev.dump_rows.get(step)
    if rows:
        return sum(row["request_id"] in set(ids) for row in rows) / len(rows)
    record = next((r for r in ev.records if int(r["step"]) == step), {"metrics": {}})
    return float(record["metrics"].get(K.SEQ_FLAGGED_FRAC, 1.0))


def _split_ids(ev: Evidence, steps: list[int]) -> list[str]:
    """The request ids in split twin groups of the dumped alarmed steps."""
    return _twin_ids(ev, steps, split_twin_sequences)


def _twin_ids(ev: Evidence, steps: list[int], pick) -> list[str]:
    """The request ids `pick` (`split_twin_sequences`, `off_twin_sequences`) finds in the dumped `steps`."""
    cfg = StatsConfig(twin_tau=StatsConfig().twin_tau * _floor_scale(ev))
    ids: list[str] = []
    for step in steps:
        rows = ev.dump_rows.get(step)
        if not rows or any(row.get("prompt_tokens") is None or row.get("response_tokens") is None for row in rows):
            continue
        batch = StepBatch.from_ragged(logp_rollout=[row["logp_rollout"] for row in rows],
                                      logp_train=[row["logp_train"] for row in rows],
                                      request_ids=[row["request_id"] for row in rows],
                                      tokens=[row["response_tokens"] for row in rows],
                                      prompt_tokens=[row["prompt_tokens"] for row in rows])
        hit = pick(batch, cfg)
        ids += [row["request_id"] for row, h in zip(rows, hit.tolist(), strict=True) if h and row["request_id"] not in ids]
    return ids[:MAX_IDS]


def _floor_scale(ev: Evidence) -> float:
    """The run's floor relative to the bf16 reference, as its records logged it (1 where none did)."""
    _, scales = metric_series(ev, K.FLOOR_SCALE)
    return float(scales[-1]) if scales.size else 1.0


def _garbage(ev: Evidence) -> Finding | None:
    """Most sequences catastrophic from the run's first step, with the weights verified and the ids shared."""
    if not ev.records or ev.source != "run":
        return None
    first = ev.records[0]
    m = first["metrics"]
    if m.get(K.SEQ_CATASTROPHIC_FRAC, 0.0) < 0.25 or m.get("sync/fingerprint_differs", 1.0) != 0.0:
        return None
    if alarms_of(ev, kind="signature", signatures=("shift_by_one", "token_id_mismatch")) or alarms_of(ev, kind="weights"):
        return None
    steps = alarm_steps(alarms_of(ev))
    evidence = [f"step {first['step']}: {m[K.SEQ_CATASTROPHIC_FRAC]:.0%} of the sequences far off (mean |d| "
                f"{m.get(K.ABS_DIFF_MEAN, 0.0):.3g}) from the run's first step, while the sync check found the engine "
                "holding the trainer's weights and both sides scored the same token ids: the engine computes garbage "
                "with the right weights, as an aliased recurrent state index does (a broken kernel would too)",
                TELLS]
    ids = [o["request_id"] for o in first.get("offenders", [])]
    return Finding("index_aliasing", GARBAGE, evidence, steps, ids[:MAX_IDS])


def _probe_state(ev: Evidence) -> Finding | None:
    """A probe-only sync-check failure (fingerprints agree) on a run whose alarmed steps have a part of their
    sequences diverging from the first token."""
    probe = [a for a in alarms_of(ev, kind="weights")
             if "differing" in a["details"] and not a["details"]["differing"] and a["details"].get("probe")]
    if not probe:
        return None
    anomalous = set(alarm_steps(alarms_of(ev)))
    early = [int(r["step"]) for r in ev.records if int(r["step"]) in anomalous
             and r["metrics"].get(K.FIRST_DIV_MIN) == 0 and 0 < r["metrics"].get(K.SEQ_FLAGGED_FRAC, 0.0) < 0.5]
    if not early:
        return None
    clean = int(ev.records[0]["step"]) < early[0] and not _alarmed(ev, int(ev.records[0]["step"]))
    evidence = [f"step {probe[0]['step']}: {probe[0]['message']}",
                f"{len(early)} alarmed step(s), from step {early[0]}, have some of their sequences (not all) diverging "
                "from their first generated token: the engine holds the trainer's weights (every fingerprint agrees) "
                "and computes otherwise per request, from its state",
                TELLS]
    steps = sorted(set(early) | {int(probe[0]["step"])})
    ids = [o["request_id"] for r in ev.records if int(r["step"]) == early[0] for o in r.get("offenders", [])]
    return Finding("stale_state" if clean else "index_aliasing", PROBE if clean else ALIASED, evidence, steps,
                   ids[:MAX_IDS])


def _alarmed(ev: Evidence, step: int) -> bool:
    return any(int(a["step"]) == step for a in alarms_of(ev))


def sparse_sequences(ev: Evidence) -> Finding | None:
    """A few far-off sequences on a model that may carry state. Not where the engine also split twins on the run's
    first step: no slot had a previous holder there, and the twins' rule (`rules.engine`) weighs stale state
    against an aliased index by how many sequences are off (index-wrap on the trained hybrid with a bf16 engine,
    seed 3: 6 far-off sequences among 48 in split groups, read as stale state at 0.85 before)."""
    early = alarms_of(ev, kind="signature", signatures=("early_divergence",))
    sparse = alarms_of(ev, kind="signature", signatures=("sparse_catastrophic", "many_catastrophic"))
    if (not early and not sparse) or ev.recurrent() is False:  # far-off sequences on a model with no state: no state cause
        return None
    steps = alarm_steps(early + sparse)
    split = alarm_steps(alarms_of(ev, kind="signature", signatures=("split_twins",)))
    if ev.records and steps[0] == int(ev.records[0]["step"]) and steps[0] in split:
        return None
    ids = catastrophic_ids(ev, early + sparse)
    a = (early or sparse)[0]
    evidence = [f"step {a['step']}: {a['message']}",
                f"{len(ids)} far-off request(s) over {len(steps)} step(s); the other sequences match"]
    if ev.records and alarm_steps(alarms_of(ev))[0] == int(ev.records[0]["step"]) and _padded_only(ev, steps[0]):
        evidence.append("the run alarmed from its first step, where no state slot had a previous holder, and every "
                        "far-off sequence is a row of a shorter prompt (left-padded to the step's longest): a "
                        "trainer's padding without position ids is as likely")
        return Finding("stale_state", PADDED_FIRST, evidence, steps, ids)
    if early:
        return Finding("stale_state", 0.85, evidence, steps, ids)
    evidence.append("the divergence does not start at the first tokens: state-index aliasing is as likely; "
                    "the scheduler context (rlcheck stress, the engine guard) tells them apart")
    return Finding("stale_state", 0.6, evidence, steps, ids)


PADDED_FIRST = 0.6
"""`sparse_sequences` on a run that alarmed from its first step, when every far-off sequence is a left-padded row: under
the padded rows' rule (`rules.position.position_ids`, 0.85 for one prompt's rows). Left padding on the random Mamba2
with a bf16 engine put 1-8 of the shorter prompts' rows far off from their first token at steps 0-1 (seeds 1-5),
none of the others; a stale state starts after the first wave of requests, on clean first steps."""


def _padded_only(ev: Evidence, step: int) -> bool:
    """The step's dump has rows of the longest prompts and shorter ones, and its far-off sequences (catastrophic, or
    diverged within their first `early_window` tokens: the dump's `first_divergence`) are all shorter ones'."""
    rows = ev.dump_rows.get(step)
    pad = left_padding(rows) if rows else None
    if pad is None or not (pad == 0).any():
        return False
    cfg = StatsConfig()
    early = np.array([row.get("first_divergence") is not None and row["first_divergence"] < cfg.early_window
                      for row in rows])
    far = catastrophic_rows(rows, cfg) | early
    return bool(far.any()) and not (far & (pad == 0)).any()
