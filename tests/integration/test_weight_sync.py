"""The collective weight sync in the real loop: trainer rank 0 (hf) broadcasts its weights to the vLLM
rollout actor over a gloo group of their own, in buckets, and the sync check still catches a spoiled
sync. A restarted engine joining a fresh group: tests/integration/test_loop_faults.py (its killed-engine
run syncs by collective)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.faults import parse_inject
from rlcheck.loop import GRPOLoop
from rlcheck.loop.presets import tiny_cpu
from rlcheck.loop.task import AdditionTask
from rlcheck.loop.weight_sync import WeightSyncConfig

COLLECTIVE = WeightSyncConfig("collective", bucket_mb=0.25)  # the tiny hybrid (~6 MB in fp32): many buckets


def _small(cfg):
    """The tiny CPU run at 4 prompts x 4 samples: the syncs are what is tested, not the learning."""
    return replace(cfg, weight_sync=COLLECTIVE, group_size=4, task=AdditionTask(num_prompts=4, seed=0))


def _run(loop: GRPOLoop, on_step=None):
    try:
        return loop.run(on_step)
    finally:
        loop.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
class TestCollectiveSync:
    def test_a_spoiled_sync_is_still_caught(self, tiny_model, ray_local, tmp_path):
        """A sync spoiled over the collective (stale-buffer: the engine fault wraps sync_weights, so it
        acts on a collective sync too; drop-sync's spoil is applied by the same engine-side call):
        the sync check names the layers at step 1, a critical weights alarm that halts there, as with
        the object store (test_faults_loop). The collective restart: test_loop_faults."""
        layers = [0, 1, 3]
        cfg = _small(tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=3, fault=parse_inject("stale-buffer")))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            result = _run(GRPOLoop(cfg, mon))
        assert result.halted and result.steps_run == 2
        (alarm,) = [a for a in result.reports[-1].alarms if a.kind == "weights"]
        assert alarm.step == 1 and alarm.severity == "critical" and alarm.details["layers"] == layers
