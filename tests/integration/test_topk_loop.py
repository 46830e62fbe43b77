"""Top-k distribution metrics in the real loop (vLLM returning its top-20, the hf trainer scoring the
same ids in its recompute pass): the engine sampling top-p while the trainer does not moves the KL
estimate far above the float32 floor, with the sampled tokens' d < 0 (BENCHMARKS.md, "Beyond the
sampled token"). A clean step's floor is checked in tests/integration/test_audit_loop.py, whose first
step is clean (one loop run fewer)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.config import HaltConfig
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.stats import StatsConfig
from rlcheck.faults import parse_inject
from rlcheck.loop import run_grpo
from rlcheck.loop.presets import tiny_cpu
from rlcheck.loop.topk_wiring import DEFAULT_TOP_K

CLEAN_KL_MAX = 1e-8
"""fp32 on both sides: measured ~2e-12 (BENCHMARKS.md); a top-p of 0.9 gives ~2e-2."""


def _run(model, tmp_path, spec: str | None, steps: int = 2) -> list[dict]:
    cfg = tiny_cpu(model, trainer="hf", steps=steps, fault=parse_inject(spec))
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, top_logprobs=DEFAULT_TOP_K))
    mcfg = MonitorConfig(run_dir=tmp_path, sinks=("jsonl",), stats=StatsConfig(distribution=True),
                         halt=HaltConfig(enabled=False), context=cfg.context())
    with Monitor(mcfg) as mon:
        assert run_grpo(cfg, mon).steps_run == steps
    return [json.loads(line)["metrics"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestTopKInTheLoop:
    def test_top_p_fault_shows_beyond_the_sampled_token(self, tiny_model, ray_local, tmp_path):
        """top-p=0.9 on the engine only: KL far above the floor, and the sampled tokens' d < 0."""
        for m in _run(tiny_model("hybrid"), tmp_path, "top-p=0.9"):
            assert m[K.DIST_KL_MEAN] > 1e4 * CLEAN_KL_MAX
            assert m[K.DIFF_MEAN] < -0.01
            assert m[K.DIST_TAIL_MASS_ROLLOUT_MEAN] < m[K.DIST_TAIL_MASS_TRAIN_MEAN]
