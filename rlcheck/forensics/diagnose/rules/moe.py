"""The diagnose rule `moe_routing`: the mismatch sits on the tokens the engine and the trainer sent to
different experts (`rlcheck/moe/*`, logged when the batches carry routing; `rlcheck.core.moe`).

On the alarmed steps, the tokens routed differently are a minority but carry most of the step's sum
|d|, at least `CONCENTRATION` times their share of the tokens: the two sides computed different
functions of those tokens, so the mismatch comes from routing (bf16 router noise, a router kernel,
a replay that is off), not from noise spread over every token.
"""

from __future__ import annotations

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.moe import CONCENTRATION, MIN_SHARE
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.queries import affected_ids, alarm_steps, alarms_of, metric_series


def moe_routing(ev: Evidence) -> Finding | None:
    """A finding when the alarmed steps' mismatch concentrates on the tokens routed differently."""
    anomalous = alarm_steps(alarms_of(ev))
    steps, share = metric_series(ev, K.MOE_ABS_DIFF_SHARE)
    agree_steps, agree = metric_series(ev, K.MOE_ROUTE_AGREE_FRAC)
    on = np.isin(steps, anomalous)
    if not anomalous or not on.any() or not np.array_equal(steps, agree_steps):
        return None
    moved = float(np.median(1.0 - agree[on]))  # the tokens' share routed differently
    carried = float(np.median(share[on]))
    if moved <= 0 or carried < MIN_SHARE or carried < CONCENTRATION * moved:
        return None
    hit = [int(s) for s in steps[on]]
    evidence = [f"on {len(hit)} alarmed step(s) {moved:.1%} of the tokens went to other experts in the engine "
                f"than in the trainer, and carry {carried:.0%} of the summed |d|",
                f"routing first differs most often at MoE layer {_first_layer(ev, hit)}: routing replay "
                "(the engine's experts in the trainer) or an fp32 router removes it"]
    return Finding("moe_routing", 0.9, evidence, hit, affected_ids(ev, hit[-1:], 0.0)[:20])


def _first_layer(ev: Evidence, steps: list[int]) -> int:
    """The MoE layer where routing first differs for the most tokens, over `steps`."""
    counts: dict[int, float] = {}
    for rec in ev.records:
        if rec["step"] in steps:
            layer = 0
            while (key := K.moe_first_diff(layer)) in rec["metrics"]:
                counts[layer] = counts.get(layer, 0.0) + rec["metrics"][key]
                layer += 1
    return max(counts, key=lambda k: counts[k]) if counts else 0
