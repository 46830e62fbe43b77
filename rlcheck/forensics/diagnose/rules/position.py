"""Diagnose rules that read where in a sequence, and in which sequences, a dump's mismatch sits
(`rlcheck.forensics.diagnose.rows`):

- `position_ids`: each row's mean |d| rises with the padding its prompt gets when the step's prompts
  are left-padded to the longest; the rows of the longest prompt are clean (a trainer scoring
  left-padded rows without position ids); not on a step whose trainer scored other token ids than the
  engine sampled (`token_id_mismatch`, `shift_by_one`): there the ids, not the positions, set |d| (an
  off-by-one on the trained hybrid with a bf16 engine moved the shorter prompts' rows alone);
- `position_dependent`: |d| rises with the token's position in its sequence, the first positions
  close, from the run's first step on (RoPE base or scaling, a sliding window);
- `stale_prefix_cache`: the rows whose prompt shares a long prefix with other prompts are off, the
  others clean, only after the run's first steps were clean (weights synced since the prefix was
  cached, the cache not reset), with no `weights` alarm (the sync check found the weights right);
- `sparse_rows`: a few rows far off from their first tokens, the rest clean (stale state, where the
  responses are too short for the catastrophic signature's rate of far-off tokens).
"""

from __future__ import annotations

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.floors import (
    ELEVATED,
    EXCESS,
    clean_level,
    floor_level,
    precision_clean_level,
)
from rlcheck.forensics.diagnose.queries import MAX_IDS, alarm_steps, alarms_of, metric_series, spearman
from rlcheck.forensics.diagnose.rows import (
    CONTRAST,
    abs_diff,
    dumped_rows,
    left_padding,
    positions,
    row_abs,
    separated,
    shared_prefix,
)
from rlcheck.forensics.diagnose.rules.engine import TELLS

MIN_SPAN = 64
"""Positions a dump must span before `position_dependent` reads a trend in them."""
LATE_RATIO, MIN_RHO = 1.5, 0.15
"""`position_dependent`: the last quarter of the positions at least this many times as far off as the first,
and |d|'s rank correlation with the position at least this (a RoPE base x 4 on the tiny random Llama:
1.8x and 0.19 over 5..357; a tiny model is sensitive at short distances too)."""
SPLIT, SEPARATED = 3.0, 0.8
"""`stale_prefix_cache` with rows that do not share the prefix: the prefix rows' mean |d| at least SPLIT x the
others' and past the excess gate at the run's floor (`EXCESS` x its level: the prefix rows alone would trip the
gate on the engine over the trainer's measure; the random Llama's at 0.091 over a measure of 0.020 when that gate
warned, seed 3), the two groups `separated` at SEPARATED. The others are
the step's own control (same engine, same noise): on a bf16 engine a stale prefix's rows stood 3.8x and 4.2x
over them at the first dumped step (the tiny Llamas, calibration seed 0: every prefix row above the cut, 28 of
the 32 others under it; a healthy bf16 run's prompt groups differ up to ~2.5x: the padded rows of
`bench_pad_floor.py`), at fp32 900x to 10,000x (BENCHMARKS.md, "The Llamas on the user's path")."""
MIN_SHARED = 64
"""Prompt tokens two different prompts must share at their start to count as a cacheable prefix (vLLM
caches whole blocks: 16 tokens on GPUs, 128 on CPU)."""


def floored_rows(ev: Evidence, rows) -> np.ndarray:
    """(N,) each row's mean |d|, at least the run's floor: rows within the precision's noise are alike (an
    exact row and one 1e-7 off on a fp32 run), so a cut between two groups never falls inside that noise."""
    return np.maximum(row_abs(rows), floor_level(ev))


def _ids(rows, picked) -> list[str]:
    order = sorted(picked, key=lambda i: -(rows[i].get("max_abs_diff") or 0.0))
    return [rows[i]["request_id"] for i in order][:MAX_IDS]


def position_ids(ev: Evidence) -> Finding | None:
    """Rows off in proportion to their prompt's left padding; unpadded rows clean; the same ids on both sides. The
    padded rows must pass the precision's clean level and `CONTRAST` x the step's unpadded rows (the step's own
    control, at the model's noise: the random Mamba2 with a bf16 engine measures 0.033, where its left padding put
    the padded rows at 0.14-0.33 and the others at 0.034, seeds 1-5, BENCHMARKS.md "Left padding on a noisy
    model"). A step whose padded rows are two prompts' or more is read before one whose are one prompt's."""
    other_ids = set(alarm_steps(alarms_of(ev, kind="signature", signatures=("token_id_mismatch", "shift_by_one"))))
    found = []
    for step, rows in dumped_rows(ev):
        pad = left_padding(rows)
        if step in other_ids or pad is None or not (pad == 0).any() or not (pad > 0).any():
            continue
        off = floored_rows(ev, rows)
        clean, padded = float(off[pad == 0].mean()), float(off[pad > 0].mean())
        rho = spearman(pad.astype(np.float64), off)
        if padded < precision_clean_level(ev) or padded < CONTRAST * clean or rho < 0.4 or \
                not separated(off, pad > 0, 0.95):
            continue
        prompts = {np.asarray(rows[i]["prompt_tokens"]).tobytes() for i in np.flatnonzero(pad > 0)}
        found.append((len(prompts) < 2, step, rows, pad, off, clean, padded, rho))
    if not found:
        return None
    one_prompt, step, rows, pad, off, clean, padded, rho = min(found, key=lambda f: f[:2])
    levels = ", ".join(f"{int(k)}: {off[pad == k].mean():.2g}" for k in np.unique(pad)[:5])
    if ev.recurrent() and _onset_after_clean(ev, step):
        return _padded_rows_of_state(step, rows, pad, padded, clean, levels)
    evidence = [
        f"step {step}: the rows whose prompt would be left-padded to the step's longest are off (mean |d| "
        f"{padded:.3g}), the {int((pad == 0).sum())} rows of the longest prompts are not ({clean:.2g})",
        f"mean |d| by pad tokens ({levels}): rank correlation {rho:.2f} with the padding; the trainer's positions "
        "shift by the padding: pass position_ids (cumsum of the attention mask - 1) with left-padded rows"]
    if one_prompt:
        evidence.append("the padded rows are the samples of one prompt: anything that moves one prompt's samples "
                        "(a temperature on its less certain answers) looks the same")
    return Finding("position_ids", ONE_PROMPT if one_prompt else 0.92, evidence, [step],
                   _ids(rows, np.flatnonzero(pad > 0)))


ONE_PROMPT = 0.85
"""`position_ids` where the padded rows are one prompt's samples: under the slope and setting rules' 0.88-0.9
(`raw-logprobs` on the trained hybrid with a bf16 engine put one 5-token prompt's 8 samples 9x off the rest), over
the dump-level likely-tokens rule's 0.8 (which one short prompt's real padding sets off at bf16 too)."""


STATE_ONSET = 0.85
"""`_padded_rows_of_state`: over the state rules' few-rows 0.8, under their split twins' 0.93."""


def _padded_rows_of_state(step: int, rows, pad: np.ndarray, padded: float, clean: float, levels: str) -> Finding:
    """The padded rows off, on a model with recurrent state, from a step after clean first steps: a trainer that
    left-pads without position ids is off on every step that pads a prompt, from the first; an engine whose
    requests start from a state slot another request held is off from the first step that reuses slots (the first
    wave gets never-used ones), on whichever requests the stale state reaches: with a bf16 engine on an
    AVX512-BF16 CPU, every sample of the trained hybrid's shorter prompts, alike, so no twin split (BENCHMARKS.md,
    "A floor measured on the run's model")."""
    return Finding("stale_state", STATE_ONSET, [
        f"step {step}: the rows of the shorter prompts are off (mean |d| {padded:.3g}; by pad tokens {levels}), the "
        f"{int((pad == 0).sum())} rows of the longest prompts are not ({clean:.2g}), and the run's first step was clean",
        "the model has recurrent state: a trainer's left padding without position ids would be off from the first "
        "step that padded a prompt, a stale state slot from the first step whose requests reuse slots, on the "
        f"requests it reaches (here whole prompts' samples alike); {TELLS}"],
        [step], _ids(rows, np.flatnonzero(pad > 0)))


def position_dependent(ev: Evidence) -> Finding | None:
    """|d| that rises with the token's position, close at the first positions, present from the first step."""
    for step, rows in dumped_rows(ev):
        pos, ad = positions(rows)
        if pos.size < 32 or np.ptp(pos) < MIN_SPAN or _onset_after_clean(ev, step):
            continue
        low = pos <= np.quantile(pos, 0.25)
        high = pos >= np.quantile(pos, 0.75)
        rho = spearman(pos.astype(np.float64), ad)
        early, late = float(ad[low].mean()), float(ad[high].mean())
        if late < clean_level(ev) or late < LATE_RATIO * early or rho < MIN_RHO:
            continue
        edges = np.quantile(pos, [0, 0.25, 0.5, 0.75, 1.0]).astype(int)
        by_pos = ", ".join(f"{a}-{b}: {ad[(pos >= a) & (pos <= b)].mean():.2g}" for a, b in zip(edges[:-1], edges[1:], strict=True))
        return Finding("position_dependent", 0.9, [
            f"step {step}: |d| rises with the token's position in its sequence (rank correlation {rho:.2f}); mean |d| "
            f"by position {by_pos}",
            f"the first quarter of the positions is {early:.2g} off, the last {late:.3g}, and the run was off from its "
            "first step: a position-dependent difference between the sides (RoPE base or scaling, sliding window, "
            "max position) rather than a per-request fault"], [step],
            _ids(rows, [i for i, row in enumerate(rows) if len(row["logp_rollout"])]))
    return None


def _onset_after_clean(ev: Evidence, step: int) -> bool:
    """The run's first step was clean next to `step`: its mean |d| below `clean_level` and below 1/CONTRAST of
    `step`'s, or (at a floor above fp32's, where the precision's own noise is most of a clean step's level: a bf16
    engine's 0.018 under a stale prefix cache's 0.05-0.06) the first step under the threshold gate at the run's
    floor (`ELEVATED` x its level) and `step` past it, or the first step under the gate on the engine's excess over
    the trainer's measure (`EXCESS`, `floor/excess`) and `step` past it (the random Llama's stale prefix at 3.3x
    its measure of 0.020 from its second step, seed 2) (records by step; False when either is missing or `step` is
    the first)."""
    steps, values = metric_series(ev, K.ABS_DIFF_MEAN)
    if steps.size < 2 or step not in steps or step == steps[0]:
        return False
    first, at = float(values[0]), float(values[steps == step][0])
    gate = ELEVATED * floor_level(ev)
    over = dict(zip(*metric_series(ev, K.FLOOR_EXCESS), strict=True))
    measured = over.get(steps[0], EXCESS) < EXCESS <= over.get(step, 0.0)
    return first < clean_level(ev) and (first * CONTRAST < at or first < gate <= at or measured)


def stale_prefix_cache(ev: Evidence) -> Finding | None:
    """Rows sharing a long prompt prefix off, the others clean, after clean first steps, weights verified."""
    if alarms_of(ev, kind="weights"):
        return None
    for step, rows in dumped_rows(ev):
        shared = shared_prefix(rows)
        if shared is None or not (shared >= MIN_SHARED).any() or not _onset_after_clean(ev, step):
            continue
        off, on = floored_rows(ev, rows), shared >= MIN_SHARED
        hit = float(off[on].mean())
        rest = float(off[~on].mean()) if (~on).any() else None
        if rest is None and hit < clean_level(ev):
            continue
        if rest is not None and (hit < EXCESS * floor_level(ev) or hit < SPLIT * rest or not separated(off, on, SEPARATED)):
            continue
        first = alarm_steps(alarms_of(ev))[0]
        contrast = (f"the {int((~on).sum())} rows without it {rest:.2g}" if rest is not None
                    else "every row shares it")
        return Finding("stale_prefix_cache", 0.95 if rest is not None else 0.8, [
            f"step {step}: the {int(on.sum())} rows whose prompt shares a {int(np.median(shared[on]))}-token prefix with "
            f"other prompts are off (mean |d| {hit:.3g}); {contrast}",
            f"the run's first step was clean and the mismatch began at step {first}, after weight syncs; no sync check "
            "or weight version found the engine's weights wrong: the prefix cache kept keys and values of old "
            "weights (call llm.reset_prefix_cache() after each sync)"], [step], _ids(rows, np.flatnonzero(on)))
    return None


FAR_RATIO = 100.0
"""How many times the off rows' peak |d| must exceed every other row's (`sparse_rows`)."""


def sparse_rows(ev: Evidence) -> Finding | None:
    """A few rows far off from one of their first tokens, every other row clean: the stale-state shape,
    read from the rows where the catastrophic signature needs longer responses or larger |d| (on a
    confident model a corrupted sequence's tokens were near-certain anyway: 0.01 nats off, the rest 1e-5).
    Which sequences are off outranks how the step's mean moves (`_growing`, 0.8: more corrupted sequences
    on later steps read as growth). None on a model with no recurrent state (a config difference puts a trained
    Llama's short-prompt rows far off from their first token: a RoPE base x 4)."""
    if ev.recurrent() is False:
        return None
    for step, rows in dumped_rows(ev):
        peak = np.array([float(abs_diff(row).max()) if len(row["logp_rollout"]) else 0.0 for row in rows])
        far = np.flatnonzero(peak >= 10 * clean_level(ev))
        rest = np.setdiff1d(np.arange(len(rows)), far)
        if not far.size or far.size > max(1, 0.1 * len(rows)) or not rest.size or \
                FAR_RATIO * peak[rest].max() > peak[far].min():
            continue
        starts = [int(np.flatnonzero(abs_diff(rows[i]) >= 0.1 * peak[i])[0]) for i in far]
        if max(starts) > 2:
            continue
        return Finding("stale_state", 0.85, [
            f"step {step}: {far.size} of {len(rows)} sequences are off (max |d| {peak[far].min():.2g} to "
            f"{peak[far].max():.2g}) from token {min(starts)} to {max(starts)}; every other sequence is within "
            f"{peak[rest].max():.2g}",
            "a few requests computed from other state than their own: stale recurrent state (a reused slot) or "
            "state aliasing; the scheduler context (rlcheck stress, the engine guard) tells them apart"],
            [step], _ids(rows, far))
    return None
