"""`rlcheck diagnose RUN_DIR|DUMP`: name the likely cause of a mismatch from its shape (design.md).

Each rule reads the evidence (step records and dumps, `rlcheck.forensics.diagnose.evidence`) for one family of
shapes and returns a `Finding` with a confidence, the evidence in words, the affected steps and the
affected request ids; the findings are ranked and the first is the verdict ("healthy" when the run
raised no alarm). Where `rlcheck localize` has run on a dump (its localize.json), the first divergent
decoder layer joins in (`rlcheck.forensics.diagnose.localized`): a finding of its own when one layer of
the engine is wrong for every request, and the layer named in the verdict's evidence. Confidences are fixed per rule strength (a signature seen on every anomalous step
outranks a level shift seen in aggregate statistics); they rank causes, they are not probabilities.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.run import Run
from rlcheck.core.stats import StatsConfig
from rlcheck.forensics.diagnose.evidence import Evidence, load_evidence
from rlcheck.forensics.diagnose.findings import CAUSES, MIN_NOISE_STEPS, Diagnosis, Finding
from rlcheck.forensics.diagnose.floors import elevated_steps, resolution
from rlcheck.forensics.diagnose.localized import load_localizations, localized_weights, name_layer
from rlcheck.forensics.diagnose.notes import RESTART_AGE, note_quarantine, note_restart, note_sampling
from rlcheck.forensics.diagnose.queries import (
    MAX_IDS,
    affected_ids,
    alarm_steps,
    alarms_of,
    metric_series,
    rising,
    spearman,
)
from rlcheck.forensics.diagnose.rules import EVIDENCE_RULES
from rlcheck.forensics.diagnose.rules.engine import SHAPES, sparse_sequences
from rlcheck.forensics.diagnose.rules.moe import moe_routing

__all__ = ["CAUSES", "RESTART_AGE", "RULES", "Diagnosis", "Finding", "diagnose"]

def diagnose(path: Run | str | Path, localizations: list[dict[str, Any]] | None = None) -> Diagnosis:
    """Diagnose a run (a `Run`, or its directory) or a dump (see the module docstring). `localizations`:
    the localize.json of its dumps, already read (default: read here)."""
    ev = load_evidence(path)
    if localizations is None:
        localizations = load_localizations(ev.run.whole_dumps() if ev.run is not None else [ev.path])
    findings = [f for rule in RULES if (f := rule(ev)) is not None]
    localized = localized_weights(localizations, [row for rows in ev.dump_rows.values() for row in rows])
    findings += [localized] if localized is not None else []
    if not findings:
        findings = [_healthy_or_unexplained(ev)]
    findings.sort(key=lambda f: -f.confidence)
    note_restart(ev, findings[0])
    note_quarantine(ev, findings[0])
    note_sampling(ev, findings[0])
    name_layer(findings[0], localizations)
    return Diagnosis(ev.source, str(ev.path), len(ev.records), findings)


# ---- one rule per family of shapes ---------------------------------------------------------------


def _misalignment(ev: Evidence) -> Finding | None:
    shift = alarms_of(ev, kind="signature", signatures=("shift_by_one",))
    tokens = alarms_of(ev, kind="signature", signatures=("token_id_mismatch",))
    if not shift and not tokens:
        return None
    evidence = []
    if shift:
        a = shift[0]
        evidence.append(f"step {a['step']}: {a['message']}")
    if tokens:
        a = tokens[0]
        evidence.append(f"step {a['step']}: {a['message']}")
    steps = alarm_steps(shift + tokens)
    evidence.append(f"on {len(steps)} step(s), first {steps[0]}")
    tau = StatsConfig().divergence_tau
    return Finding("token_misalignment", 0.95 if shift and tokens else 0.85, evidence, steps,
                   affected_ids(ev, steps, tau))


def _logit_processing(ev: Evidence) -> Finding | None:
    slope = alarms_of(ev, kind="signature", signatures=("systematic_slope",))
    if not slope:
        return None
    misaligned = set(alarm_steps(alarms_of(ev, kind="signature", signatures=("shift_by_one", "token_id_mismatch"))))
    # a slope over garbage (mean |d| past the 1-nat hard limit: an engine computing nonsense, sure of its
    # samples) is no reweighting of the likely tokens (`rules.engine`)
    garbage = {int(r["step"]) for r in ev.records if r["metrics"].get(K.ABS_DIFF_MEAN, 0.0) > 1.0}
    slope = [a for a in slope if a["step"] not in misaligned | garbage]
    if not slope:
        return None
    steps = alarm_steps(slope)
    anomalous = alarm_steps(alarms_of(ev))
    s = np.median([a["details"]["slope"] for a in slope])
    c = np.median([a["details"]["corr"] for a in slope])
    share = len(steps) / max(len(anomalous), 1)
    evidence = [f"d = logp_train - logp_rollout follows logp_rollout on {len(steps)} of {len(anomalous)} "
                f"alarmed steps (median slope {s:.3f}, corr {c:.2f})",
                "a trainer temperature of T x (1 + slope) relative to the engine's would give this slope"]
    return Finding("logit_processing", 0.6 + 0.3 * share, evidence, steps,
                   affected_ids(ev, steps, StatsConfig().divergence_tau))


def _slot_context(ev: Evidence) -> Finding | None:
    """A dump whose failing sequences carry the scheduler's slot context (`rlcheck stress`): aliasing
    when most of them shared a state block with another live request (or used one they were not
    given); stale state when nearly all reused a block another request held before, diverge from the
    first tokens, and the requests that got a never-used block pass."""
    rows = [row for rs in ev.dump_rows.values() for row in rs if "failed" in row and "slot_reused" in row]
    failing = [row for row in rows if row["failed"]]
    if not failing:
        return None
    steps = sorted(s for s, rs in ev.dump_rows.items() if any(row.get("failed") for row in rs))
    ids = [row["request_id"] for row in failing][:MAX_IDS]
    aliased = [row for row in failing if row.get("shared_with") or row.get("block_used") != row.get("block")]
    if len(aliased) >= len(failing) / 2:
        a = next((row for row in aliased if row.get("block_used") != row.get("block")), aliased[0])
        block = f"block {a['block']}" + (f" used as {a['block_used']}" if a.get("block_used") != a["block"] else "")
        return Finding("index_aliasing", 0.95, [
            f"{len(aliased)} of {len(failing)} failing requests used a state block another live request used in "
            f"the same step (e.g. {a['request_id']}: {block}, with "
            f"{', '.join((a.get('shared_with') or [])[:3]) or 'an unrecorded holder'})",
            f"blocks up to {max(row['block'] or 0 for row in rows)} were handed out: a state index past a boundary "
            "aliases another request's state; cutting memory (fewer blocks) hides it, more concurrency brings it"],
            steps, ids)
    reused = [row for row in failing if row["slot_reused"]]
    early = [row for row in reused if row.get("first_divergence") == 0]
    fresh = [row for row in rows if row["slot_reused"] is False]
    if len(reused) >= 0.9 * len(failing) and len(early) >= len(reused) / 2:
        r = reused[0]
        return Finding("stale_state", 0.95, [
            f"{len(reused)} of {len(failing)} failing requests started in a state block another request held "
            f"before (e.g. {r['request_id']} in block {r['block']} after {r['previous_holder']})",
            f"{len(early)} of them diverge from their first generated token; "
            f"{sum(bool(row['failed']) for row in fresh)} of the {len(fresh)} requests that got a never-used "
            "block fail: the first prefill read the previous holder's state instead of zeros"],
            steps, ids)
    return None


GUARD_CAUSE = {"slot_unique": "index_aliasing", "in_pool": "index_aliasing", "offset_fits": "index_aliasing",
               "prefill_from_zero": "stale_state", "freed_reinit": "stale_state"}


def _guard_violations(ev: Evidence) -> list[dict[str, Any]]:
    """The engine guard's violations: DIR/guard/violations.jsonl (a run, a stress dump), else the
    first violation of each guard alarm the loop logged (`rlcheck.engines.guard.violations_to_alarms`)."""
    data = ev.guard()
    if data is not None and data.violations:
        return [v.to_dict() for v in data.violations]
    return [{**a["details"]["first"], "request_ids": a["details"].get("request_ids", []), "alarm_step": a["step"]}
            for a in alarms_of(ev, kind="signature", signatures=("engine_guard",))]


def _engine_guard(ev: Evidence) -> Finding | None:
    """Lifecycle invariants the engine guard saw broken at the engine step where it happened: (ii)
    shared slots (and (iii), (iv): ids past the pool or the offset range) are index aliasing; (i) a
    first prefill from old state and (v) a read of a slot nobody reinitialised are stale state. The
    cause with more broken requests is the finding."""
    from rlcheck.core.run.guard_record import INVARIANT

    by_cause: dict[str, list[dict[str, Any]]] = {}
    for v in _guard_violations(ev):
        by_cause.setdefault(GUARD_CAUSE.get(v["check"], "unexplained"), []).append(v)
    if not by_cause:
        return None
    cause, vs = max(by_cause.items(), key=lambda kv: len({v["request_id"] for v in kv[1]}))
    known = {row["request_id"] for rows in ev.dump_rows.values() for row in rows}  # the ids the dumps use

    def ids_of(v: dict[str, Any]) -> list[str]:
        if v.get("request_ids"):
            return v["request_ids"]
        return [v["request_id"] if v["request_id"] in known else v.get("rollout_request_id") or v["request_id"]]

    ids = list(dict.fromkeys(r for v in vs for r in ids_of(v)))
    names = ", ".join(f"{INVARIANT[c]} {c}" for c in dict.fromkeys(v["check"] for v in vs))
    evidence = [f"the engine guard saw invariant {names} broken by {len(ids)} request(s) over "
                f"{len({v['step'] for v in vs})} engine step(s); first: {vs[0]['message']}",
                "read from the scheduler's slot assignment and the Mamba metadata at that step, not inferred from logprobs"]
    others = {c: len(o) for c, o in by_cause.items() if c != cause}
    if others:
        evidence.append("also " + ", ".join(f"{n} violation(s) pointing at {c}" for c, n in others.items()))
    first_step = int(ev.records[0]["step"]) if ev.records else 0
    steps = sorted({int(v.get("alarm_step", v.get("call_step") if v.get("call_step") is not None else first_step))
                    for v in vs})
    return Finding(cause, 0.97, evidence, steps, ids[:MAX_IDS])


def _weights(ev: Evidence) -> Finding | None:
    direct = alarms_of(ev, kind="weights")
    if direct:  # sequences tagged with weights older than the trainer's: no shape needed
        ids = [rid for a in direct for rid in a["details"].get("request_ids", [])]
        evidence = [f"step {direct[0]['step']}: {direct[0]['message']}"]
        # only the sync check's probe failed, every fingerprint agreed: the same weights computing otherwise
        probe_only = all("differing" in a["details"] and not a["details"]["differing"] for a in direct)
        evidence += ["the fingerprints agree: the engine holds the trainer's weights and computes otherwise with them "
                     "(a model config such as RoPE or a window, a kernel, logit processing)"] if probe_only else []
        return Finding("weights_out_of_sync", 0.85 if probe_only else 0.99, evidence, alarm_steps(direct),
                       list(dict.fromkeys(ids))[:50])
    periodic = alarms_of(ev, kind="periodic")
    if periodic:
        a = periodic[0]
        p, phase = int(a["details"]["period"]), int(a["details"]["phase"])
        steps, values = metric_series(ev, a["metric"])
        clean = values[steps % p != phase]
        base = np.median(clean) if clean.size else 0.0
        spread = 1.4826 * np.median(np.abs(clean - base)) if clean.size else 0.0
        # a spike triples the clean level (exact engines) or stands 3 sigma out of its noise (bf16 ones)
        cut = min(3 * base, base + 3 * spread)
        hit = [int(s) for s, v in zip(steps, values, strict=True) if s % p == phase and v > cut]
        evidence = [f"{a['metric']} spikes every {p} steps (steps = {phase} mod {p}), {len(hit)} spikes "
                    f"between clean steps: the shape of a weight sync left out every {p} updates"]
        return Finding("weights_out_of_sync", 0.9, evidence, hit, affected_ids(ev, hit[-3:], 0.0)[:20])
    behind_steps, behind = metric_series(ev, "loop/weights_behind")
    anomalous = alarm_steps(alarms_of(ev))
    lagging = [int(s) for s, b in zip(behind_steps, behind, strict=True) if b > 0 and int(s) in anomalous]
    growing = _growing(ev, anomalous)
    if lagging:
        evidence = [f"the loop reports rollout weights behind the trainer's on {len(lagging)} alarmed step(s), "
                    f"first {lagging[0]}", *(growing.evidence if growing else [])]
        return Finding("weights_out_of_sync", 0.95, evidence, lagging, affected_ids(ev, lagging[-1:], 0.0)[:20])
    return growing


def _growing(ev: Evidence, anomalous: list[int]) -> Finding | None:
    """Mismatch that grows step after step since it appeared: syncs stopped (stale weights)."""
    if not anomalous:
        return None
    steps, values = metric_series(ev, K.ABS_DIFF_MEAN)
    after = steps >= anomalous[0]
    x, y = steps[after], values[after]
    if not rising(x, y):
        return None
    evidence = [f"mean |d| grows from {y[0]:.3g} at step {x[0]} to {y[-1]:.3g} at step {x[-1]} "
                f"(rank correlation with the step {spearman(x, y):.2f}): weights not synced since step ~{x[0]}"]
    return Finding("weights_out_of_sync", 0.8, evidence, [int(s) for s in x], affected_ids(ev, [int(x[-1])], 0.0)[:20])


def _numeric_noise(ev: Evidence) -> Finding | None:
    """A persistent, flat, symmetric rise over most sequences, with no signature."""
    anomalous = alarm_steps([a for a in alarms_of(ev) if a["kind"] != "weights"])  # its own evidence only
    if anomalous and len(anomalous) < MIN_NOISE_STEPS:  # a gate warns once and re-arms: the steps past it count
        anomalous = sorted(set(anomalous) | set(elevated_steps(ev)))
    signatures = alarms_of(ev, kind="signature")
    if ev.recurrent() is False:  # far-off sequences are no state shape on a model without state: noise may make a few
        signatures = [a for a in signatures if a["details"].get("signature") not in SHAPES]  # (a random Llama, bf16 x 16)
    if len(anomalous) < MIN_NOISE_STEPS or signatures or alarms_of(ev, kind="periodic"):
        return None
    steps, values = metric_series(ev, K.ABS_DIFF_MEAN)
    after = steps >= anomalous[0]
    x, y = steps[after], values[after]
    persistent = len(anomalous) >= 0.8 * x.size
    flat = not rising(x, y)
    m = {}
    for key in (K.DIFF_MEAN, K.ABS_DIFF_P50):
        s, v = metric_series(ev, key)  # a record may lack a key: select by step, not by position
        m[key] = float(np.median(v[s >= anomalous[0]])) if np.any(s >= anomalous[0]) else math.nan
    level = float(np.median(y))
    symmetric = abs(m[K.DIFF_MEAN]) <= 0.3 * level  # False when the key was never logged (nan)
    widespread = m[K.ABS_DIFF_P50] >= 0.2 * level
    if not (persistent and flat and symmetric and widespread):
        return None
    evidence = [f"mean |d| rose to a steady {level:.3g} at step {x[0]} and stays there",
                f"symmetric (mean d {m[K.DIFF_MEAN]:.2g}) and spread over the tokens (median |d| "
                f"{m[K.ABS_DIFF_P50]:.2g}): precision noise, not a per-request fault"]
    return Finding("numeric_noise", 0.7, evidence, [int(s) for s in x], affected_ids(ev, [int(x[-1])], 0.0)[:20])


def _healthy_or_unexplained(ev: Evidence) -> Finding:
    alarms = alarms_of(ev)
    steps, values = metric_series(ev, K.ABS_DIFF_MEAN)
    if not alarms:
        top = f"; mean |d| at most {values.max():.3g}" if values.size else ""
        limit = resolution(ev)
        return Finding("healthy", 0.9 if len(ev.records) >= 10 else 0.6,
                       [f"{len(ev.records)} step(s), no alarm{top}", *([limit] if limit else [])])
    kinds = sorted({f"{a['kind']}:{a['metric'].removeprefix(K.PREFIX)}" for a in alarms})
    return Finding("unexplained", 0.3, [f"{len(alarms)} alarm(s) ({', '.join(kinds[:6])}) fit no known shape"],
                   alarm_steps(alarms))


RULES = (_engine_guard, _slot_context, _misalignment, _logit_processing, sparse_sequences, _weights, _numeric_noise, moe_routing,
         *EVIDENCE_RULES)
