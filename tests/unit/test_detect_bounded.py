"""The detectors' memory is bounded: after their windows fill, 12,000 steps (with spikes and alarms
on the way) leave them holding exactly as many values as 5,000 did, and every history is a deque
with a maximum length. (benchmarks/bench_load.py measures RSS over 100,000 steps.)"""

from __future__ import annotations

import json
import re
from collections import deque

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.detect import DetectorsConfig, build_detectors
from rlcheck.core.stats import StatsConfig, compute
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

POOL = 256
SPIKES = range(3000, 4000, 7)  # a periodic stretch: periodic, robust-z and threshold alarms fire


def count_items(obj, seen: set[int] | None = None) -> int:
    """Elements held in every container reachable from `obj` (dicts, lists, deques, objects' fields)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), np.ndarray)):
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return len(obj) + sum(count_items(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        return len(obj) + sum(count_items(v, seen) for v in obj)
    return count_items(vars(obj), seen) if hasattr(obj, "__dict__") else 0


def deques(obj, seen: set[int] | None = None) -> list[deque]:
    """Every deque reachable from `obj`."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), np.ndarray)):
        return []
    seen.add(id(obj))
    own = [obj] if isinstance(obj, deque) else []
    if isinstance(obj, dict):
        return own + [d for v in obj.values() for d in deques(v, seen)]
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        return own + [d for v in obj for d in deques(v, seen)]
    return own + (deques(vars(obj), seen) if hasattr(obj, "__dict__") else [])


def metric_stream():
    """Per step a metrics dict: the statistics of one of POOL small synthetic steps, jittered so no
    two steps repeat, spiking x3 on SPIKES."""
    data, stats, rng = SyntheticConfig(num_sequences=8, mean_length=32), StatsConfig(), np.random.default_rng(0)
    pool = [compute(synthetic_batch(data, s), stats)[0] for s in range(POOL)]
    watched = (K.ABS_DIFF_MEAN, K.ABS_DIFF_CLIPPED_MEAN, K.KL_K3, K.ABS_DIFF_P99, K.MULT_PROB_ERROR, K.PROB_ABS_DIFF_MEAN)
    step = 0
    while True:
        metrics = dict(pool[step % POOL])
        scale = rng.lognormal(0.0, 0.05) * (3.0 if step in SPIKES else 1.0)
        metrics.update({k: metrics[k] * scale for k in watched if k in metrics})
        yield step, metrics
        step += 1


@pytest.mark.slow
class TestDetectorMemory:
    def test_state_stops_growing_once_the_windows_fill(self):
        """Items held and state.json bytes (less digits) at 12,000 steps equal those at 5,000; alarms fired in between."""
        detectors = build_detectors(DetectorsConfig())
        seen: dict[int, tuple[int, int]] = {}
        num_alarms = 0
        for step, metrics in metric_stream():
            num_alarms += sum(len(det.update(step, metrics)) for det in detectors.values())
            if step + 1 in (5_000, 12_000):
                state = {kind: det.state_dict() for kind, det in detectors.items()}
                seen[step + 1] = (count_items(detectors), len(re.sub(r"[0-9]", "", json.dumps(state))))
            if step + 1 == 12_000:
                break
        (items_5k, bytes_5k), (items_12k, bytes_12k) = seen[5_000], seen[12_000]
        assert num_alarms > 0
        assert items_12k == items_5k
        assert bytes_12k <= 1.02 * bytes_5k  # digits aside (steps 4,199 and 11,199 differ by one), the same state
        assert all(d.maxlen is not None and len(d) <= d.maxlen for d in deques(detectors))
