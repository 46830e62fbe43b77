"""Bitwise-equal sides (issue 42 item 6): agreement computed on both sides (a true on-policy engine:
batch-invariant kernels, deterministic inference) is the best health there is: one note, no crash, and
`MonitorConfig(true_on_policy=True)` makes any difference a critical alarm. A copy of the rollout side
handed as the trainer's is refused from what can be seen of it: one buffer passed as both sides (any
`StepBatch` constructor), verl's bypass mode in its config (the adapter's preflight)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from rlcheck import MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.stats import StatsConfig, compute_partial
from rlcheck.errors import ConfigError, InputError


def monitor(tmp_path, **kw):
    return Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), **kw))


def twin_batch(n=4, length=12, seed=0, off=0.0):
    """Both sides the same values in separate buffers (two bitwise-equal computations); `off` added to
    one token of the trainer's side."""
    rng = np.random.default_rng(seed)
    lr = [-rng.exponential(1.0, length) for _ in range(n)]
    lt = [x.copy() for x in lr]
    lt[1][3] += off
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=[f"r{i}" for i in range(n)])


def notes(record) -> list[str]:
    return [str(w.message) for w in record if "agree bitwise" in str(w.message)]


class TestBitwiseEqualSides:
    def test_bitwise_equal_is_healthy_with_one_note(self, tmp_path):
        """Three bitwise-equal steps: observed, no alarm, one note in all (an InputError on every step before)."""
        mon = monitor(tmp_path)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            reports = [mon.observe(step, twin_batch(seed=step)) for step in range(3)]
        assert [r.alarms for r in reports] == [[], [], []] and reports[0].metrics[K.ABS_DIFF_MAX] == 0
        assert len(notes(record)) == 1 and "true_on_policy" in notes(record)[0]

    def test_observe_partial_takes_them_too(self, tmp_path):
        """The reduced path (observe_across_ranks' rank 0) observes them as well."""
        batch = twin_batch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert monitor(tmp_path).observe_partial(0, compute_partial(batch, StatsConfig()), batch).alarms == []

    def test_fp32_noise_is_healthy_without_a_note(self, tmp_path):
        """A healthy fp32 pair (|d| ~ 1e-6, vLLM against HF) is observed as before, with no note."""
        rng = np.random.default_rng(1)
        lr = [-rng.exponential(1.0, 12) for _ in range(4)]
        lt = [np.minimum(x + rng.normal(0, 1e-6, 12), 0.0) for x in lr]
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            report = monitor(tmp_path).observe(0, StepBatch.from_ragged(logp_rollout=lr, logp_train=lt,
                                                                        request_ids=list("abcd")))
        assert report.alarms == [] and notes(record) == []


class TestTrueOnPolicy:
    def test_declared_run_alarms_on_any_difference(self, tmp_path):
        """Declared true on-policy: bitwise-equal steps pass with no note; one token off by 1e-9 is a
        critical alarm on abs_diff_max that halts at once, naming the setting."""
        mon = monitor(tmp_path, true_on_policy=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert mon.observe(0, twin_batch()).alarms == []
        assert notes(record) == []
        with pytest.raises(MismatchHalt, match="true_on_policy") as halt:
            mon.observe(1, twin_batch(seed=1, off=-1e-9))
        (alarm,) = [a for a in halt.value.report.alarms if a.severity == "critical"]
        assert (alarm.kind, alarm.metric) == ("threshold", K.ABS_DIFF_MAX)

    def test_declared_run_alarms_with_halting_off(self, tmp_path):
        """With halting off the difference is still a critical alarm (like every hard limit)."""
        from rlcheck import HaltConfig

        mon = monitor(tmp_path, true_on_policy=True, halt=HaltConfig(enabled=False))
        report = mon.observe(0, twin_batch(off=1e-7))
        assert [a.severity for a in report.alarms] == ["critical"] and not report.halted

    def test_setting_must_be_a_bool(self, tmp_path):
        with pytest.raises(ConfigError, match="true_on_policy"):
            MonitorConfig(run_dir=tmp_path, true_on_policy="yes")


class TestOneBufferRefused:
    """One buffer passed as both sides is an InputError wherever a batch is built."""

    def test_from_packed_numpy(self):
        x = -np.random.default_rng(0).exponential(1.0, 20)
        with pytest.raises(InputError, match="itself"):
            StepBatch.from_packed(x, x, np.array([0, 10, 20]), ["a", "b"])
        with pytest.raises(InputError, match="itself"):
            StepBatch.from_packed(x, x[:], np.array([0, 10, 20]), ["a", "b"])  # a view of it

    def test_from_padded_torch_and_its_numpy_view(self):
        torch = pytest.importorskip("torch")
        t = -torch.rand(2, 8)
        mask = torch.ones(2, 8, dtype=torch.bool)
        for train in (t, t.numpy()):
            with pytest.raises(InputError, match="itself"):
                StepBatch.from_padded(t, train, mask, ["a", "b"])

    def test_from_ragged_one_sequence(self):
        x = -np.random.default_rng(0).exponential(1.0, 20)
        with pytest.raises(InputError, match=r"logp_train\[1\]"):
            StepBatch.from_ragged([x.copy(), x], [x.copy(), x], ["a", "b"])

    def test_two_halves_of_one_array_are_two_sides(self):
        """Rollout and trainer stacked in one array and passed as its two rows are distinct buffers."""
        both = -np.random.default_rng(0).exponential(1.0, (2, 20))
        both[1] += 1e-3
        StepBatch.from_packed(both[0], both[1], np.array([0, 20]), ["a"])


class TestVerlBypassMode:
    def test_preflight_refuses_bypass_mode(self):
        """verl's config with algorithm.rollout_correction.bypass_mode=True is refused at attach: verl then
        never recomputes the logprobs (and never calls the method rlcheck's hook wraps)."""
        from rlcheck.integrations.verl import preflight

        config = {"algorithm": {"rollout_correction": {"bypass_mode": True}},
                  "actor_rollout_ref": {"model": {"path": "/nonexistent"}}}
        with pytest.raises(ConfigError, match="bypass_mode"):
            preflight(config)
        config["algorithm"]["rollout_correction"]["bypass_mode"] = False
        assert preflight(config) == ()


class TestAcrossRanks:
    def test_observe_across_ranks_takes_bitwise_equal_sides(self, tmp_path):
        """observe_across_ranks (a real one-rank gloo group) observes bitwise-equal sides without error."""
        import torch.distributed as dist

        from rlcheck.distributed import observe_across_ranks

        if dist.is_initialized():
            pytest.skip("a process group is already up in this process")
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mon = monitor(tmp_path)
                report = observe_across_ranks(mon, 0, twin_batch(), mon.cfg.stats)
        finally:
            dist.destroy_process_group()
        assert report.alarms == [] and report.metrics[K.ABS_DIFF_MAX] == 0
