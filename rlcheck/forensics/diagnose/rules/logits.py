"""The diagnose rule for a logit-processing mismatch read from a dump's tokens, where the signature
detector's linear slope falls short: on a peaked model, a temperature difference moves probability
between the likely and the unlikely tokens, d = logp_train - logp_rollout is not a line in
logp_rollout (it rises from 0 at the certain tokens, then falls), and its correlation with
logp_rollout stays under the detector's 0.5 (0.43 with raw logprobs at T = 0.7 on the tiny trained
Llama). What does not change is its sign on the likely-but-not-certain tokens: one side gives them
more probability than the other on most of them, a temperature, top-p or raw logprobs; a
perturbed model or a stale cache moves them both ways. A reweighting moves a likely token's logprob by
less than the logprob itself; an engine computing garbage (aliased state) gives its own samples far
more probability than the trainer does, also on every one of them, by several nats: not this.
"""

from __future__ import annotations

import numpy as np

from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.floors import floor_level
from rlcheck.forensics.diagnose.queries import alarm_steps, alarms_of
from rlcheck.forensics.diagnose.rows import CLEAN, abs_diff, dumped_rows

LIKELY = (-2.0, -0.01)
"""logp_rollout of the tokens read: neither certain (d ~ 0 either way) nor in the tail."""
MIN_TOKENS = 20
SAME_SIGN = 0.75
"""Share of those tokens whose d has one sign (not all: sharpening takes probability from a likely token
when another is likelier still; raw logprobs at T = 0.7 on the trained Llama: 83% and 94%)."""
MIN_MEAN = 0.005
MIN_CORR = 0.3
ONE_SIGN, SPREAD, GARBAGE = 0.97, 0.9, 1.0
"""A renormalised distribution (top-p, top-k on the engine only): on a model with no likely token to read (a
random one, every token ~7 nats), d = log Z of the nucleus' mass Z < 1 is one-signed on (nearly) every
token past the floor, of (nearly) every sequence; a per-request fault (corrupted sequences, one-signed
too) stays in a few."""


def logit_processing_tokens(ev: Evidence) -> Finding | None:
    """One side gives the likely tokens more probability on most of them (see the module)."""
    anomalous = set(alarm_steps(alarms_of(ev)))
    for step, rows in dumped_rows(ev):
        if step not in anomalous or not rows:
            continue
        lr = np.concatenate([np.asarray(row["logp_rollout"], np.float64) for row in rows])
        keep = np.concatenate([abs_diff(row) > max(CLEAN, floor_level(ev)) for row in rows])  # past the precision's noise
        d = np.concatenate([np.asarray(row["logp_train"], np.float64) for row in rows]) - lr
        likely = keep & (lr > LIKELY[0]) & (lr < LIKELY[1])
        if likely.sum() < MIN_TOKENS:
            continue
        up = float(np.mean(d[likely] > 0))
        share, level = max(up, 1 - up), float(np.mean(np.abs(d[likely])))
        unsure = keep & (lr < LIKELY[1])
        corr = float(np.corrcoef(lr[unsure], d[unsure])[0, 1]) if unsure.sum() > 2 else 0.0
        if share < SAME_SIGN or level < MIN_MEAN or abs(corr) < MIN_CORR or level > np.mean(-lr[likely]):
            continue  # past the tokens' own |logp| it is no reweighting: a far-off engine's samples (selection)
        side = "the trainer" if up > 0.5 else "the engine"
        return Finding("logit_processing", 0.8, [
            f"step {step}: on {share:.0%} of the {int(likely.sum())} likely-but-not-certain tokens (logp_rollout in "
            f"{LIKELY}) {side} gives the sampled token more probability (mean |d| {level:.3g}); d follows "
            f"logp_rollout (corr {corr:.2f}, under the slope detector's bar)",
            "one side's distribution is sharper than the other's: a temperature applied on one side "
            "only, raw logprobs (logprobs_mode) against a tempered trainer, or top-p/top-k renormalisation"],
            [step], [row["request_id"] for row in rows][:20])
    return _renormalised(ev, anomalous)


def _renormalised(ev: Evidence, anomalous: set[int]) -> Finding | None:
    """d one-signed on the tokens past the floor of nearly every sequence (see ONE_SIGN)."""
    floor = max(CLEAN, floor_level(ev))
    for step, rows in dumped_rows(ev):
        if step not in anomalous or not rows:
            continue
        ds = [np.asarray(row["logp_train"], np.float64) - np.asarray(row["logp_rollout"], np.float64) for row in rows]
        past = [np.abs(d) > floor for d in ds]
        d = np.concatenate([x[p] for x, p in zip(ds, past, strict=True)])
        reached = np.mean([p.any() for p in past])
        if d.size < MIN_TOKENS or reached < SPREAD or np.mean(np.abs(np.concatenate(ds))) > GARBAGE:
            continue  # past a nat on average: garbage, not the log of a kept mass (`rules.engine`)
        down = float(np.mean(d < 0))
        if max(down, 1 - down) < ONE_SIGN:
            continue
        side = "the engine" if down > 0.5 else "the trainer"
        return Finding("logit_processing", 0.8, [
            f"step {step}: on {max(down, 1 - down):.1%} of the {d.size} tokens past the floor, in {reached:.0%} of the "
            f"sequences, {side} gives the sampled token more probability (median |d| {np.median(np.abs(d)):.3g})",
            "one side's distribution is renormalised over fewer tokens than the other's: top-p or top-k on that side "
            "only (d = log of the kept mass), or a temperature"], [step], [row["request_id"] for row in rows][:20])
