"""The diagnose rule for an engine that computes otherwise than the trainer from one step on while the
weight versions agree (`engine_shift`): its weights (a partial sync, a bad load) or a layer or kernel
changed under the same version tag. verl's real trainer with one decoder layer perturbed inside vLLM
from a sync on (`tests/verl_cpu/faults.py`, `perturb-layer=1@5`) is the recorded case: clean steps at
0.008-0.011 nats, then 0.20 and 0.15 on every sequence, the versions verl put in the batch in order.

It fires when, from an alarmed step S to the run's last step (at least `MIN_STEPS` steps):

- every step's clipped mean |d| is at least `SHIFT` x the median of the unalarmed steps before S (at
  least `MIN_BASELINE` of them: a fault present from the run's first step has no clean level to shift
  from) and past the precision's gate (`floors.elevated_steps`);
- the rise is spread over the tokens, not a few far-off sequences: the median token moved (median |d|
  >= `SPREAD` x the mean, or above every clean step's median before S);
- every one of those steps logged the weights lag (`rlcheck/weights/max_lag`) at 0 and raised no
  weights alarm: the versions agree, so "not synced" is not what the tags say.

From the run's first step there is no clean level to shift from; on a model with no recurrent state (the
context's `model_type`: no state to be stale) the rule also fires when every step from the first is past a bf16
engine's gate (`NOISE_CEILING`) on most tokens and skewed (`SKEW`), with the sync check's fingerprints agreeing at the first step
(the weights checked directly, not by their tags) and the versions agreeing after: the engine computes otherwise
with the trainer's weights from its start, its config (a RoPE base x 4 on the tiny trained Llama: 0.18 to 0.20
nats every step, 15-25% of the sequences catastrophic and no trend with the position, which `position_dependent`
reads on a model that is close at short distances), a layer or a kernel (`_from_first_step`).

Its confidence (`CONFIDENCE`; `WITHIN_NOISE` for a shift no larger than a bf16 engine's noise) ranks it
under every rule with a signature or direct evidence: it names
what the level alone can say, the engine side and the step it started, and the command that tells a layer
from the weights (`rlcheck localize` on a dump of those steps).
"""

from __future__ import annotations

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.floors import LEVELS
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.floors import ELEVATED, floor_level
from rlcheck.forensics.diagnose.queries import affected_ids, alarm_steps, alarms_of, metric_series

SHIFT = 5.0
"""Level over the clean steps before it (the verl case: 14x and 16x; bf16's step-to-step spread of a
healthy run stays under 2x)."""
MIN_BASELINE = 2
MIN_STEPS = 2
"""Steps from the shift to the run's end: one step off is a spike (rows, a batch), not a changed engine."""
SPREAD = 0.1
"""Median |d| over mean |d| on the shifted steps: a rise on many tokens, not a few far-off sequences (whose
median stays at the floor, < 0.05 of the mean); the verl runs: 0.15 to 0.52, and 0.084 to 0.097 on one
(its median 0.0085 and 0.0074, over the 0.0021 to 0.0055 of every clean step before: the other test)."""
CONFIDENCE = 0.75
"""Under every rule with a signature or direct evidence (>= 0.8), over numeric noise (0.7) and a temperature
slope seen on a minority of the alarmed steps (0.6 + 0.3 x share: a verl run's perturbed layer sloped one
of its steps), when the shifted level stands past a bf16 engine's noise (`NOISE_CEILING`)."""
NOISE_CEILING = ELEVATED * LEVELS["bfloat16"]
"""0.05: a shift to no more than a bf16 engine's gate may be a precision changed mid-run (an fp32 engine
switched to bf16: 0 to 0.014 in `tests/integration/test_faults_loop.py`'s bf16-noise@12): numeric noise names
that better, this finding ranks under it (`WITHIN_NOISE`)."""
WITHIN_NOISE = 0.65


SKEW = 0.3
"""From the first step: the median step's mean d at most -SKEW x its mean |d|. An engine sampling from its own
distribution gets its samples scored lower by the trainer (the mean of d is -KL(engine || trainer)), a precision's
noise leaves d symmetric (`numeric_noise` asks |mean d| <= 0.3 x the level): the trained Llama with a RoPE base
x 4 at -0.4 to -0.59."""


MAX_STARTS = 3
"""Alarmed steps tried as the shift's start: the first ones inside the run's last stretch of elevated steps
(a start outside it cannot hold to the run's end). A run of thousands of alarmed steps costs one pass."""


def engine_shift(ev: Evidence) -> Finding | None:
    steps, level = metric_series(ev, K.ABS_DIFF_CLIPPED_MEAN)
    if steps.size < MIN_BASELINE + MIN_STEPS:
        return _from_first_step(ev, steps, level)
    elevated = level > ELEVATED * floor_level(ev)  # (S,) past the gate at the run's floor (`floors.elevated_steps`)
    tail = steps.size - int(np.argmin(elevated[::-1])) if not elevated.all() else 0  # first index of the last stretch
    alarmed = np.isin(steps, alarm_steps(alarms_of(ev)))  # (S,)
    for i in np.flatnonzero(alarmed[tail:])[:MAX_STARTS] + tail:
        found = _shift_from(ev, int(steps[i]), steps, level, alarmed)
        if found is not None:
            return found
    return _from_first_step(ev, steps, level)


def _shift_from(ev: Evidence, start: int, steps: np.ndarray, level: np.ndarray, alarmed: np.ndarray) -> Finding | None:
    before = (steps < start) & ~alarmed
    after = steps >= start
    if before.sum() < MIN_BASELINE or after.sum() < MIN_STEPS:
        return None
    base = float(np.median(level[before]))
    shifted = [int(s) for s in steps[after]]
    if not np.all(level[after] >= SHIFT * base):
        return None
    if not _spread(ev, shifted, [int(x) for x in steps[before]]) or not _versions_agree(ev, shifted):
        return None
    ratio = float(np.min(level[after])) / base if base > 0 else float("inf")
    dumps = [s for s in shifted if s in ev.dump_rows]
    where = (f"RUN/dumps/step_{dumps[0]:06d}" if dumps else
             "a dump of one of these steps (none was written: rlcheck dumps a step when it halts or first alarms)")
    confidence = CONFIDENCE if float(np.min(level[after])) > NOISE_CEILING else WITHIN_NOISE
    return Finding("engine_shift", confidence, [
        f"from step {start} on the engine and the trainer part: clipped mean |d| "
        f"{', '.join(f'{v:.3g}' for v in level[after])} at steps {', '.join(map(str, shifted))}, "
        f"at least {ratio:.0f}x the {int(before.sum())} clean steps before ({base:.3g}), on most tokens",
        "every one of those steps carries the trainer's weight version (weights lag 0): the engine holds what "
        "the tags say and computes otherwise with it, its weights (a partial sync, a bad load) or a layer or kernel",
        f"to tell a layer from the weights: `rlcheck localize {where}` re-runs the worst requests through a "
        "fresh engine and the reference layer by layer (a first divergent layer there is the engine's code or "
        "config; none diverging points at the weights the live engine held)",
    ], shifted, affected_ids(ev, shifted[:1], 0.0)[:20])


def _from_first_step(ev: Evidence, steps: np.ndarray, level: np.ndarray) -> Finding | None:
    """Every step off on most tokens from the run's first, past a bf16 engine's gate, the first step's fingerprints
    agreeing, on a model with no recurrent state (see the module docstring)."""
    if ev.recurrent() is not False or not steps.size or ev.source != "run":
        return None
    shifted = [int(s) for s in steps]
    first = next((r for r in ev.records if int(r["step"]) == shifted[0]), {"metrics": {}})
    if first["metrics"].get("sync/fingerprint_differs") != 0.0 or float(level.min()) <= max(NOISE_CEILING, ELEVATED * floor_level(ev)):
        return None
    if not _spread(ev, shifted, []) or not _versions_agree(ev, shifted):
        return None
    signed, size = (float(np.median(metric_series(ev, key)[1])) for key in (K.DIFF_MEAN, K.ABS_DIFF_MEAN))
    if not -signed > SKEW * size:  # symmetric: precision noise of that size (`numeric_noise`), not another distribution
        return None
    return Finding("engine_shift", CONFIDENCE, [
        f"from the run's first step the engine and the trainer part: clipped mean |d| "
        f"{', '.join(f'{v:.3g}' for v in level[:6])}{' ...' if level.size > 6 else ''} at steps "
        f"{', '.join(map(str, shifted[:6]))}{' ...' if level.size > 6 else ''}, on most tokens; the trainer scores the "
        f"engine's samples lower (mean d {signed:.3g} against mean |d| {size:.3g}): the engine samples from a "
        "distribution of its own",
        f"the sync check's fingerprints found the trainer's weights in the engine at step {shifted[0]}, and the model "
        f"({ev.model_type()}) has no recurrent state: the engine computes otherwise with the right weights from its "
        "start, its config (RoPE base or scaling, sliding window, norm epsilon: compare the engine's effective model "
        "config, hf_overrides included, with the trainer's; `rlcheck preflight`), a layer or a kernel",
        "to tell them apart: `rlcheck localize RUN/dumps/step_...` re-runs the worst requests through a fresh engine "
        "and the reference layer by layer (a first divergent attention layer with equal weights is a config or kernel)",
    ], shifted, affected_ids(ev, shifted[:1], 0.0)[:20])


def _spread(ev: Evidence, shifted: list[int], clean: list[int]) -> bool:
    p50_steps, p50 = metric_series(ev, K.ABS_DIFF_P50)
    mean_steps, mean = metric_series(ev, K.ABS_DIFF_MEAN)
    by_step = dict(zip(p50_steps.tolist(), p50.tolist(), strict=True))
    means = dict(zip(mean_steps.tolist(), mean.tolist(), strict=True))
    moved = max((by_step[s] for s in clean if s in by_step), default=float("inf"))  # the clean steps' highest median
    return all(s in by_step and s in means and (by_step[s] >= SPREAD * means[s] or by_step[s] > moved) for s in shifted)


def _versions_agree(ev: Evidence, shifted: list[int]) -> bool:
    lag_steps, lags = metric_series(ev, K.WEIGHTS_MAX_LAG)
    lag = dict(zip(lag_steps.tolist(), lags.tolist(), strict=True))
    weights = set(alarm_steps(alarms_of(ev, kind="weights")))
    return all(s in lag and lag[s] == 0 and s not in weights for s in shifted)
