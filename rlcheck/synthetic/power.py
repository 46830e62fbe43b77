"""Fault shapes the detectors' defaults were not tuned on (issue 28, item 4), laid on field streams:
what `benchmarks/bench_power.py` measures and `tests/unit/test_detector_power.py` checks.

    stream = FieldStream(dataclasses.replace(PARTIAL_SPIKES.field, seed=100), PARTIAL_SPIKES.fault, 1200)
    batch, k = corrupt_tail(stream.batches(0)[0], seed=100, i=0)   # sequence k's last 8-15 tokens corrupted

- `PARTIAL_SPIKES`: a third of the sequences at 2.5x the floor every 12 observations, on the gapped
  field stream (steps 0, 2, 4, ...; AR(1) step wobble, log-normal lengths of median 900 tokens,
  Student-t innovations) with tail tokens at |d| 1.5-7 nats and a floor growing 10x over 3,000 steps.
- `corrupt_tail`: one sequence whose last 8-15 tokens the trainer scores with d ~ N(0, 2) nats
  (clipped at logprob 0: a near-certain token cannot become more likely).
- `DRIFTS`: mean |d| flat at 0.01, then the engine's mismatch rising 3.3x over 30 steps (an SGLang
  path's drift report) or 5x over 450 (OLMo-3 RLVR at learning rate 0: the weights fixed, the
  mismatch growing, then the run failed). The policy's samples do not change; the probe batch
  (`FieldStream.probe_batch`) sees the engine's growth and nothing else.
The healthy counterpart of the drifts is `SCENARIOS["long-cot-growing"]` (growth that longer, less
peaked responses explain). Seeds as in `rlcheck.synthetic.scenarios`: defaults set on the
calibration seeds, reported on the held-out ones, tested on the test seeds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.synthetic.field import FieldConfig, FieldFault


@dataclass(frozen=True)
class Shape:
    """A fault shape: a field stream, the fault laid on it, and the observations to run."""

    name: str
    field: FieldConfig
    fault: FieldFault
    num_steps: int


PARTIAL_SPIKES = Shape(
    "partial-spikes",
    FieldConfig(num_sequences=24, median_length=900, step_stride=2, growth=10.0, growth_steps=3000,
                tail_min=1.5, tail_max=7.0),
    FieldFault("partial-spikes", onset=300, every=12, value=2.5, frac=1 / 3),
    300 + 12 * 80,
)

_FLAT = FieldConfig(num_sequences=24, median_length=900, floor=0.01, growth=1.0)

DRIFTS = (
    Shape("drift-3.3x/30", _FLAT, FieldFault("drift", onset=300, value=3.3, ramp=30), 360),
    Shape("drift-5x/450", _FLAT, FieldFault("drift", onset=300, value=5.0, ramp=450), 800),
)

TAIL_SPAN = (8, 15)
"""The corrupted tail: its length in tokens, drawn uniformly in this range (inclusive)."""


def corrupt_tail(batch: StepBatch, seed: int, i: int, sigma: float = 2.0) -> tuple[StepBatch, int]:
    """`batch` with the last 8-15 tokens of one random sequence scored d ~ N(0, sigma) nats by the
    trainer (logprob_train = min(logprob_rollout + d, 0)): (batch, the sequence's index)."""
    rng = np.random.default_rng([seed, i, 0x7A11])
    cu, lr = batch.cu_seqlens, batch.logp_rollout
    k = int(rng.integers(batch.num_sequences))
    a, b = int(cu[k]), int(cu[k + 1])
    span = min(int(rng.integers(TAIL_SPAN[0], TAIL_SPAN[1] + 1)), b - a)
    lt = batch.logp_train.copy()
    lt[b - span : b] = np.minimum(lr[b - span : b] + rng.normal(0.0, sigma, span), 0.0)
    return dataclasses.replace(batch, logp_train=lt), k
