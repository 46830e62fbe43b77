"""What a step's batch adds to its metrics beside the statistics, tallied (`rlcheck.core.tally`) so that a
step held by several ranks is reduced exactly (`rlcheck.distributed`): the importance-sampling
correction's metrics (`rlcheck/corr/*`, when `MonitorConfig.correction` is set) and the MoE routing
agreement (`rlcheck/moe/*`, when the batch carries `routing`), both over the tokens of the sequences
the step keeps (quarantine)."""

from __future__ import annotations

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import PREFIX, Correction, CorrectionConfig, correct, metrics_of, response_mask
from rlcheck.core.moe import routing_tally
from rlcheck.core.moe import tally_metrics as routing_metrics_of
from rlcheck.core.tally import Tally


def batch_tally(batch: StepBatch, keep: np.ndarray | None,
                correction: CorrectionConfig | None) -> tuple[Correction | None, Tally]:
    """(the step's `Correction` of `correction`, None when off; the tally of it and of the batch's MoE
    routing) for the sequences `keep` keeps (None: all)."""
    tally, found = Tally(), None
    if correction is not None and correction.enabled:
        found = correct(batch, keep, correction)
        tally.add(found.tally)
    if batch.routing is not None:
        tally.add(routing_tally(batch.routing, batch.logp_train - batch.logp_rollout, response_mask(batch, keep)))
    return found, tally


def tally_metrics(tally: Tally, correction: CorrectionConfig | None) -> dict[str, float]:
    """The `rlcheck/corr/*` (of `correction`) and `rlcheck/moe/*` metrics of a (merged) `batch_tally`."""
    out = {} if correction is None else {PREFIX + k: v for k, v in metrics_of(tally, correction).items()}
    out.update(routing_metrics_of(tally))
    return out
