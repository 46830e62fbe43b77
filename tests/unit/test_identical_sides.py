"""Value-equal sides (issue 26 item 4): a trainer side that is the rollout side's values (verl bypass
mode through the v1 transfer queue, a loop passing the engine's logprobs twice) is an InputError in
Monitor.observe, observe_partial (the path of observe_across_ranks) and every adapter, never "healthy"."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck import Monitor, MonitorConfig, StepBatch
from rlcheck.core.stats import StatsConfig, compute_partial
from rlcheck.errors import InputError


def monitor(tmp_path):
    return Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",)))


def twin_batch(n=4, length=12, seed=0):
    """Both sides the same values in separate buffers (what verl's v1 transfer queue hands over)."""
    rng = np.random.default_rng(seed)
    lr = [-rng.exponential(1.0, length) for _ in range(n)]
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=[x.copy() for x in lr],
                                 request_ids=[f"r{i}" for i in range(n)])


class TestIdenticalSides:
    def test_observe_refuses_value_equal_sides(self, tmp_path):
        """Bitwise-equal sides on every token raise an InputError that says they are identical and why."""
        with pytest.raises(InputError, match="identical") as err:
            monitor(tmp_path).observe(0, twin_batch())
        assert "bypass" in str(err.value)

    def test_observe_partial_refuses_value_equal_sides(self, tmp_path):
        """The reduced path (observe_across_ranks' rank 0) refuses them too."""
        batch = twin_batch()
        with pytest.raises(InputError, match="identical"):
            monitor(tmp_path).observe_partial(0, compute_partial(batch, StatsConfig()), batch)

    def test_fp32_noise_is_healthy(self, tmp_path):
        """A healthy fp32 pair (|d| ~ 1e-6, vLLM against HF) is observed as before."""
        rng = np.random.default_rng(1)
        lr = [-rng.exponential(1.0, 12) for _ in range(4)]
        lt = [np.minimum(x + rng.normal(0, 1e-6, 12), 0.0) for x in lr]
        report = monitor(tmp_path).observe(0, StepBatch.from_ragged(logp_rollout=lr, logp_train=lt,
                                                                    request_ids=list("abcd")))
        assert report.alarms == []

    def test_short_equal_batch_is_allowed(self, tmp_path):
        """A few tokens that agree exactly (a saturated model's 0.0 logprobs) can be legitimately equal."""
        batch = StepBatch.from_ragged(logp_rollout=[np.zeros(3)], logp_train=[np.zeros(3)], request_ids=["a"])
        assert monitor(tmp_path).observe(0, batch).alarms == []

    def test_observe_across_ranks_refuses_value_equal_sides(self, tmp_path):
        """observe_across_ranks (a real one-rank gloo group) raises the same InputError on every rank: it
        travels as its name and message (`_sendable`)."""
        import torch.distributed as dist

        from rlcheck.distributed import observe_across_ranks
        from rlcheck.distributed.failures import sendable as _sendable

        if dist.is_initialized():
            pytest.skip("a process group is already up in this process")
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            mon = monitor(tmp_path)
            with pytest.raises(InputError, match="identical") as err:
                observe_across_ranks(mon, 0, twin_batch(), mon.cfg.stats)
        finally:
            dist.destroy_process_group()
        assert _sendable(err.value) == "InputError"
