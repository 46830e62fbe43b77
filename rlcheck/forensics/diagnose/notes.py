"""What diagnose adds to its verdict's evidence beyond the cause: the sequences the run quarantined,
alarms that came right after a fresh rollout engine started, and what the dump records of the engine's
sampling and precision (`rlcheck.core.run.context`) where it explains the verdict."""

from __future__ import annotations

import math
from collections import Counter

from rlcheck.core import metrics as K
from rlcheck.core.run.context import read_context
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding

RESTART_AGE = "loop/steps_since_engine_restart"
"""The loop's `rlcheck.loop.recovery.STEPS_SINCE_RESTART` (spelled here: diagnose does not import the loop)."""


def note_quarantine(ev: Evidence, verdict: Finding) -> None:
    """The quarantined sequences (records' `"quarantined"`) in the evidence; a step past max_frac was judged whole."""
    held, over = [], []
    for r in ev.records:
        whole = any(a.get("kind") == "quarantine" and a.get("metric") == K.QUARANTINE_FRAC for a in r.get("alarms") or ())
        (over if whole else held).extend((int(r["step"]), q) for q in r.get("quarantined") or ())
    where = f" (their sequences: {ev.path / 'quarantine'})" if ev.source == "run" else ""
    if held:
        steps = sorted({s for s, _ in held})
        why = ", ".join(f"{n} {r}" for r, n in Counter(q.get("reason", "?") for _, q in held).most_common())
        verdict.evidence.append(f"{len(held)} sequence(s) quarantined on {len(steps)} step(s) from step {steps[0]}: "
                                f"{why}; the verdict is of the sequences kept{where}")
    if over:
        steps = sorted({s for s, _ in over})
        verdict.evidence.append(f"step {steps[0]}: {sum(1 for s, _ in over if s == steps[0])} sequences condemned, past "
                                f"the quarantine's max_frac: too many to mask, the step was judged whole{where}")


def note_restart(ev: Evidence, verdict: Finding) -> None:
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


def note_sampling(ev: Evidence, verdict: Finding) -> None:
    """The dump's record of how the engine sampled, where it explains the verdict: raw logprobs at a
    temperature, or logit processing on the engine's side (a logit-processing mismatch); the dtype the
    engine ran (numeric noise)."""
    ctx = read_context(ev.meta())
    s = ctx.sampling
    if verdict.cause == "logit_processing":
        if s.logprobs_mode == "raw_logprobs" and not s.greedy and s.temperature not in (None, 1.0):
            verdict.evidence.append(f"the dump records logprobs_mode=raw_logprobs at T={s.temperature:g}: the engine's "
                                    "logprobs are of the untempered logits, the trainer's of logits / T "
                                    "(use processed_logprobs)")
        if s.processing:
            named = ", ".join(f"{k}={v!r}" for k, v in s.processing.items())
            verdict.evidence.append(f"the dump records logit processing on the engine's side ({named}); the trainer "
                                    "scores log_softmax(logits / T) without it")
    elif verdict.cause == "numeric_noise" and ctx.engine.precision:
        verdict.evidence.append(f"the dump records the engine ran in {ctx.engine.precision}")
