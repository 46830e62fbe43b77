"""`rlcheck diagnose RUN_DIR|DUMP`: name the likely cause of a mismatch from its shape (design.md).

Each rule reads the evidence (step records and dumps, `rlcheck.forensics.evidence`) for one family of
shapes and returns a `Finding` with a confidence, the evidence in words, the affected steps and the
affected request ids; the findings are ranked and the first is the verdict ("healthy" when the run
raised no alarm). Confidences are fixed per rule strength (a signature seen on every anomalous step
outranks a level shift seen in aggregate statistics); they rank causes, they are not probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.run import Run
from rlcheck.core.stats import MIN_LOGPROB, StatsConfig
from rlcheck.core.stats.sequences import catastrophic_sequences
from rlcheck.forensics.evidence import Evidence, load_evidence

CAUSES = {
    "healthy": "healthy: the engine and the trainer agree",
    "numeric_noise": "numeric noise (bf16, kernels, batch variance)",
    "logit_processing": "temperature / logit-processing mismatch",
    "weights_out_of_sync": "weights not synced, or synced late",
    "stale_state": "stale recurrent state (Mamba slot reused, decode before prefill)",
    "index_aliasing": "state-index overflow / aliasing (a slot offset that wrapped)",
    "token_misalignment": "token misalignment (off-by-one, chat template, tokenizer drift)",
    "unexplained": "alarms that match no known shape",
}
MAX_IDS = 50
RESTART_AGE = "loop/steps_since_engine_restart"
"""The loop's `rlcheck.loop.recovery.STEPS_SINCE_RESTART` (spelled here: diagnose does not import the loop)."""


@dataclass
class Finding:
    cause: str
    confidence: float
    evidence: list[str]
    affected_steps: list[int] = field(default_factory=list)
    affected_request_ids: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return CAUSES[self.cause]

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "confidence": round(self.confidence, 3),
                "evidence": self.evidence, "affected_steps": self.affected_steps,
                "affected_request_ids": self.affected_request_ids}


@dataclass
class Diagnosis:
    source: str
    path: str
    num_steps: int
    findings: list[Finding]

    @property
    def verdict(self) -> Finding:
        return self.findings[0]

    @property
    def healthy(self) -> bool:
        return self.verdict.cause == "healthy"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "num_steps": self.num_steps,
                "verdict": self.verdict.to_dict(), "findings": [f.to_dict() for f in self.findings]}


def diagnose(path: Run | str | Path) -> Diagnosis:
    """Diagnose a run (a `Run`, or its directory) or a dump (see the module docstring)."""
    ev = load_evidence(path)
    findings = [f for rule in RULES if (f := rule(ev)) is not None]
    if not findings:
        findings = [_healthy_or_unexplained(ev)]
    findings.sort(key=lambda f: -f.confidence)
    _note_restart(ev, findings[0])
    return Diagnosis(ev.source, str(ev.path), len(ev.records), findings)


# ---- reading the evidence ----------------------------------------------------------------------


def _alarms(ev: Evidence, *, kind: str | None = None, signatures: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for r in ev.records:
        for a in r.get("alarms", []):
            if (kind is None or a["kind"] == kind) and (not signatures or a["details"].get("signature") in signatures):
                out.append(a)
    return out


def _steps(alarms: list[dict]) -> list[int]:
    return sorted({int(a["step"]) for a in alarms})


def _series(ev: Evidence, key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r["metrics"][key]) for r in ev.records if r["metrics"].get(key) is not None]
    steps, values = zip(*pairs, strict=True) if pairs else ((), ())
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)


def _affected_ids(ev: Evidence, steps: list[int], min_abs_diff: float) -> list[str]:
    """Request ids at `steps` whose max |d| reaches `min_abs_diff`: every sequence where the step has a
    dump, the logged offenders (top-k) elsewhere."""
    ids: list[str] = []
    by_step = {r["step"]: r for r in ev.records}
    for s in steps:
        rows = ev.dump_rows.get(s) or by_step.get(s, {}).get("offenders", [])
        hit = sorted((row for row in rows if (row.get("max_abs_diff") or 0.0) >= min_abs_diff),
                     key=lambda row: -row["max_abs_diff"])
        ids += [row["request_id"] for row in hit if row["request_id"] not in ids]
    return ids[:MAX_IDS]


def _catastrophic_rows(rows: list[dict[str, Any]], cfg: StatsConfig) -> np.ndarray:
    """(N,) bool: the dump's sequences the statistics count as catastrophic (`catastrophic_sequences`:
    a rate of their compared tokens at |d| >= catastrophic_tau), or holding a non-finite logprob
    among their compared tokens (NaN, inf or a sentinel below MIN_LOGPROB), as `rlcheck.core.stats` does."""
    lens = np.array([len(row["logp_rollout"]) for row in rows], dtype=np.int64)  # (N,)
    cu = np.concatenate([[0], np.cumsum(lens)])  # (N+1,)
    if not rows or cu[-1] == 0:
        return np.zeros(len(rows), dtype=bool)
    lr = np.concatenate([np.asarray(row["logp_rollout"], dtype=np.float64) for row in rows])  # (M,)
    lt = np.concatenate([np.asarray(row["logp_train"], dtype=np.float64) for row in rows])  # (M,)
    mask = np.concatenate([np.ones(n, dtype=bool) if row.get("mask") is None else np.asarray(row["mask"], dtype=bool)
                           for row, n in zip(rows, lens.tolist(), strict=True)])
    finite = (lr >= MIN_LOGPROB) & (lt >= MIN_LOGPROB)  # False for NaN, -inf and sentinels
    valid = mask & finite
    with np.errstate(invalid="ignore"):
        ad = np.where(valid, np.abs(lt - lr), 0.0)
    seq_of = np.repeat(np.arange(len(rows)), lens)  # (M,)
    counts = np.bincount(seq_of, weights=valid, minlength=len(rows))
    bad = np.bincount(seq_of, weights=mask & ~finite, minlength=len(rows)) > 0
    return catastrophic_sequences(ad, cu, counts, cfg) | bad


def _catastrophic_ids(ev: Evidence, alarms: list[dict[str, Any]]) -> list[str]:
    """Request ids of the catastrophic sequences at the alarms' steps, worst max |d| first: exactly
    those of the step's dump, where it has one; elsewhere the logged offenders can only approximate
    (they carry no rate of tokens): the worst of them at max |d| >= catastrophic_tau (or non-finite),
    as many as the step's signature counted."""
    cfg = StatsConfig()
    count = {}
    for a in alarms:
        count[int(a["step"])] = max(count.get(int(a["step"]), 0), int(a["details"].get("count", 0)))
    by_step = {r["step"]: r for r in ev.records}
    ids: list[str] = []
    for s in sorted(count):
        if s in ev.dump_rows:
            rows = ev.dump_rows[s]
            hit = [row for row, cat in zip(rows, _catastrophic_rows(rows, cfg).tolist(), strict=True) if cat]
        else:
            rows = by_step.get(s, {}).get("offenders", [])
            hit = [row for row in rows if row.get("nonfinite") or (row.get("max_abs_diff") or 0.0) >= cfg.catastrophic_tau]
            hit = sorted(hit, key=lambda row: (not row.get("nonfinite"), -(row.get("max_abs_diff") or 0.0)))[:count[s]]
        hit.sort(key=lambda row: -(row.get("max_abs_diff") or 0.0))
        ids += [row["request_id"] for row in hit if row["request_id"] not in ids]
    return ids[:MAX_IDS]


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 3 or np.ptp(y) == 0:
        return 0.0
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _rising(x: np.ndarray, y: np.ndarray) -> bool:
    """At least 4 points that climb with the step (rank correlation >= 0.8) to a last third at least
    1.5x the first third (medians: one noisy end point does not decide)."""
    if x.size < 4 or _spearman(x, y) < 0.8:
        return False
    third = max(1, x.size // 3)
    return bool(np.median(y[-third:]) >= 1.5 * np.median(y[:third]))


# ---- one rule per family of shapes ---------------------------------------------------------------


def _misalignment(ev: Evidence) -> Finding | None:
    shift = _alarms(ev, kind="signature", signatures=("shift_by_one",))
    tokens = _alarms(ev, kind="signature", signatures=("token_id_mismatch",))
    if not shift and not tokens:
        return None
    evidence = []
    if shift:
        a = shift[0]
        evidence.append(f"step {a['step']}: {a['message']}")
    if tokens:
        a = tokens[0]
        evidence.append(f"step {a['step']}: {a['message']}")
    steps = _steps(shift + tokens)
    evidence.append(f"on {len(steps)} step(s), first {steps[0]}")
    tau = StatsConfig().divergence_tau
    return Finding("token_misalignment", 0.95 if shift and tokens else 0.85, evidence, steps,
                   _affected_ids(ev, steps, tau))


def _logit_processing(ev: Evidence) -> Finding | None:
    slope = _alarms(ev, kind="signature", signatures=("systematic_slope",))
    if not slope:
        return None
    misaligned = set(_steps(_alarms(ev, kind="signature", signatures=("shift_by_one", "token_id_mismatch"))))
    slope = [a for a in slope if a["step"] not in misaligned]
    if not slope:
        return None
    steps = _steps(slope)
    anomalous = _steps(_alarms(ev))
    s = np.median([a["details"]["slope"] for a in slope])
    c = np.median([a["details"]["corr"] for a in slope])
    share = len(steps) / max(len(anomalous), 1)
    evidence = [f"d = logp_train - logp_rollout follows logp_rollout on {len(steps)} of {len(anomalous)} "
                f"alarmed steps (median slope {s:.3f}, corr {c:.2f})",
                "a trainer temperature of T x (1 + slope) relative to the engine's would give this slope"]
    return Finding("logit_processing", 0.6 + 0.3 * share, evidence, steps,
                   _affected_ids(ev, steps, StatsConfig().divergence_tau))


def _sparse_sequences(ev: Evidence) -> Finding | None:
    early = _alarms(ev, kind="signature", signatures=("early_divergence",))
    sparse = _alarms(ev, kind="signature", signatures=("sparse_catastrophic",))
    if not early and not sparse:
        return None
    steps = _steps(early + sparse)
    ids = _catastrophic_ids(ev, early + sparse)
    a = (early or sparse)[0]
    evidence = [f"step {a['step']}: {a['message']}",
                f"{len(ids)} far-off request(s) over {len(steps)} step(s); the other sequences match"]
    if early:
        return Finding("stale_state", 0.85, evidence, steps, ids)
    evidence.append("the divergence does not start at the first tokens: state-index aliasing is as likely; "
                    "the scheduler context (rlcheck stress, the engine guard) tells them apart")
    return Finding("stale_state", 0.6, evidence, steps, ids)


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
            for a in _alarms(ev, kind="signature", signatures=("engine_guard",))]


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
    periodic = _alarms(ev, kind="periodic")
    if periodic:
        a = periodic[0]
        p, phase = int(a["details"]["period"]), int(a["details"]["phase"])
        steps, values = _series(ev, a["metric"])
        clean = values[steps % p != phase]
        base = np.median(clean) if clean.size else 0.0
        spread = 1.4826 * np.median(np.abs(clean - base)) if clean.size else 0.0
        # a spike triples the clean level (exact engines) or stands 3 sigma out of its noise (bf16 ones)
        cut = min(3 * base, base + 3 * spread)
        hit = [int(s) for s, v in zip(steps, values, strict=True) if s % p == phase and v > cut]
        evidence = [f"{a['metric']} spikes every {p} steps (steps = {phase} mod {p}), {len(hit)} spikes "
                    f"between clean steps: the shape of a weight sync left out every {p} updates"]
        return Finding("weights_out_of_sync", 0.9, evidence, hit, _affected_ids(ev, hit[-3:], 0.0)[:20])
    behind_steps, behind = _series(ev, "loop/weights_behind")
    anomalous = _steps(_alarms(ev))
    lagging = [int(s) for s, b in zip(behind_steps, behind, strict=True) if b > 0 and int(s) in anomalous]
    growing = _growing(ev, anomalous)
    if lagging:
        evidence = [f"the loop reports rollout weights behind the trainer's on {len(lagging)} alarmed step(s), "
                    f"first {lagging[0]}", *(growing.evidence if growing else [])]
        return Finding("weights_out_of_sync", 0.95, evidence, lagging, _affected_ids(ev, lagging[-1:], 0.0)[:20])
    return growing


def _growing(ev: Evidence, anomalous: list[int]) -> Finding | None:
    """Mismatch that grows step after step since it appeared: syncs stopped (stale weights)."""
    if not anomalous:
        return None
    steps, values = _series(ev, K.ABS_DIFF_MEAN)
    after = steps >= anomalous[0]
    x, y = steps[after], values[after]
    if not _rising(x, y):
        return None
    evidence = [f"mean |d| grows from {y[0]:.3g} at step {x[0]} to {y[-1]:.3g} at step {x[-1]} "
                f"(rank correlation with the step {_spearman(x, y):.2f}): weights not synced since step ~{x[0]}"]
    return Finding("weights_out_of_sync", 0.8, evidence, [int(s) for s in x], _affected_ids(ev, [int(x[-1])], 0.0)[:20])


def _numeric_noise(ev: Evidence) -> Finding | None:
    """A persistent, flat, symmetric rise over most sequences, with no signature."""
    anomalous = _steps(_alarms(ev))
    if not anomalous or _alarms(ev, kind="signature") or _alarms(ev, kind="periodic"):
        return None
    steps, values = _series(ev, K.ABS_DIFF_MEAN)
    after = steps >= anomalous[0]
    x, y = steps[after], values[after]
    persistent = len(anomalous) >= 0.8 * x.size
    flat = not _rising(x, y)
    m = {}
    for key in (K.DIFF_MEAN, K.ABS_DIFF_P50):
        s, v = _series(ev, key)  # a record may lack a key: select by step, not by position
        m[key] = float(np.median(v[s >= anomalous[0]])) if np.any(s >= anomalous[0]) else math.nan
    level = float(np.median(y))
    symmetric = abs(m[K.DIFF_MEAN]) <= 0.3 * level  # False when the key was never logged (nan)
    widespread = m[K.ABS_DIFF_P50] >= 0.2 * level
    if not (persistent and flat and symmetric and widespread):
        return None
    evidence = [f"mean |d| rose to a steady {level:.3g} at step {x[0]} and stays there",
                f"symmetric (mean d {m[K.DIFF_MEAN]:.2g}) and spread over the tokens (median |d| "
                f"{m[K.ABS_DIFF_P50]:.2g}): precision noise, not a per-request fault"]
    return Finding("numeric_noise", 0.7, evidence, [int(s) for s in x], _affected_ids(ev, [int(x[-1])], 0.0)[:20])


def _healthy_or_unexplained(ev: Evidence) -> Finding:
    alarms = _alarms(ev)
    steps, values = _series(ev, K.ABS_DIFF_MEAN)
    if not alarms:
        top = f"; mean |d| at most {values.max():.3g}" if values.size else ""
        return Finding("healthy", 0.9 if len(ev.records) >= 10 else 0.6, [f"{len(ev.records)} step(s), no alarm{top}"])
    kinds = sorted({f"{a['kind']}:{a['metric'].removeprefix(K.PREFIX)}" for a in alarms})
    return Finding("unexplained", 0.3, [f"{len(alarms)} alarm(s) ({', '.join(kinds[:6])}) fit no known shape"],
                   _steps(alarms))


def _note_restart(ev: Evidence, verdict: Finding) -> None:
    """Alarms on the step a fresh rollout engine started, or the next: say so (empty caches, re-synced
    weights) in the verdict's evidence."""
    extra = {}
    if ev.source == "dump":  # the loop's scalars are in the dump's meta, not in its recomputed record
        extra = ev.meta().get("metrics", {})
    steps = [r["step"] for r in ev.records
             if r.get("alarms") and 0 <= {**r["metrics"], **extra}.get(RESTART_AGE, math.inf) <= 1]
    if steps:
        verdict.evidence.append(f"alarm(s) at step(s) {', '.join(map(str, steps[:5]))} came right after the rollout "
                                "engine was restarted (a fresh engine: empty caches, weights re-synced); loop.jsonl "
                                "has the restart")


RULES = (_engine_guard, _slot_context, _misalignment, _logit_processing, _sparse_sequences, _weights, _numeric_noise)
