"""Monitor: the public API, logging, state and resume, the halt policy and its evidence."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rlcheck import HaltConfig, MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.detect import DetectorsConfig, SignatureConfig
from rlcheck.core.run.dump import read_dump
from rlcheck.core.run.journal import read_jsonl
from rlcheck.core.stats import compute_partial, merge
from rlcheck.errors import InputError, RLCheckError, RunDirError
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

SMALL = SyntheticConfig(num_sequences=24, mean_length=40)


def ragged(rng, n=8, length=30, shift=0.0, ids_prefix="r"):
    lr = [-rng.exponential(1.0, length) for _ in range(n)]
    lt = [x + rng.normal(0, 1e-3, length) + shift for x in lr]
    lt = [np.minimum(x, 0.0) for x in lt]
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=[f"{ids_prefix}{i}" for i in range(n)], tokens=None)


def monitor(tmp_path, **kw):
    return Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), **kw))


class TestMonitorAPI:
    def test_public_api_as_documented(self, tmp_path):
        """The README's calls work as written and return metrics, alarms and offenders."""
        mon = monitor(tmp_path)
        report = mon.observe(0, ragged(np.random.default_rng(0)))
        assert isinstance(report.metrics, dict) and all(isinstance(v, float) for v in report.metrics.values())
        assert report.alarms == [] and report.offenders[0].request_id.startswith("r")
        assert {"request_id", "index", "max_abs_diff", "first_divergence"} <= set(report.offenders[0].to_dict())

    def test_jsonl_line_per_step(self, tmp_path):
        """Every observed step is one JSONL record with metrics, alarms, offenders and the |d| histogram."""
        mon = monitor(tmp_path)
        rng = np.random.default_rng(1)
        for step in range(3):
            mon.observe(step, ragged(rng))
        records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
        assert sum(records[0]["abs_diff_hist"]["counts"]) == records[0]["metrics"][K.TOKEN_COUNT]
        assert records[0]["metrics"][K.MONITOR_SECONDS] > 0

    @pytest.mark.parametrize("step", [-1, 1.5, "3", True])
    def test_bad_step(self, tmp_path, step):
        """A step that is not a non-negative integer is an InputError."""
        with pytest.raises(InputError, match="step"):
            monitor(tmp_path).observe(step, ragged(np.random.default_rng(0)))

    def test_not_a_batch(self, tmp_path):
        """Passing arrays instead of a StepBatch says how to build one."""
        with pytest.raises(InputError, match="from_ragged"):
            monitor(tmp_path).observe(0, {"logp_rollout": [1]})

    def test_repeated_step_warns_and_logs(self, tmp_path):
        """A step that does not increase is logged anyway, with a warning (nothing is lost)."""
        mon = monitor(tmp_path)
        rng = np.random.default_rng(0)
        mon.observe(5, ragged(rng))
        with pytest.warns(UserWarning, match="after step 5"):
            mon.observe(5, ragged(rng))
        assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2

    def test_observe_partial_matches_observe(self, tmp_path):
        """Statistics merged from two halves give the same report as the whole batch (but the
        sequences' level spread, which only a whole batch has)."""
        batch = synthetic_batch(SMALL, 0)
        whole = Monitor(MonitorConfig(run_dir=tmp_path / "a", sinks=())).observe(0, batch)
        halves = [compute_partial(batch.select(range(0, 12))), compute_partial(batch.select(range(12, 24)))]
        merged = Monitor(MonitorConfig(run_dir=tmp_path / "b", sinks=())).observe_partial(0, merge(halves))
        assert K.SEQ_LEVEL_SPREAD not in merged.metrics
        for key, value in whole.metrics.items():
            if key not in (K.MONITOR_SECONDS, K.SEQ_LEVEL_SPREAD):
                assert merged.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
        assert merged.offenders == whole.offenders


    @pytest.mark.parametrize("left", [False, True])
    def test_observe_padded_matches_packed(self, tmp_path, left):
        """[B, T] torch tensors with a response mask (left or right padded) give the packed batch's report."""
        torch = pytest.importorskip("torch")
        rng = np.random.default_rng(3)
        lens = [5, 12, 1, 9, 12]
        lr = [-rng.exponential(1.0, n) for n in lens]
        lt = [np.minimum(x + rng.normal(0, 0.05, len(x)), 0.0) for x in lr]
        ids = [f"q{i}" for i in range(len(lens))]
        packed = StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=ids)
        width = max(lens)
        pad_r = torch.full((len(lens), width), 3.0, dtype=torch.float64)  # padding holds garbage
        pad_t = torch.full((len(lens), width), -7.0, dtype=torch.float64)
        mask = torch.zeros(len(lens), width, dtype=torch.bool)
        for b, n in enumerate(lens):
            cols = slice(width - n, width) if left else slice(0, n)
            pad_r[b, cols], pad_t[b, cols], mask[b, cols] = torch.tensor(lr[b]), torch.tensor(lt[b]), True
        padded = StepBatch.from_padded(pad_r, pad_t, mask, request_ids=ids)
        a = monitor(tmp_path / "packed").observe(0, packed)
        b = monitor(tmp_path / "padded").observe(0, padded)
        for key, value in a.metrics.items():
            if key != K.MONITOR_SECONDS:
                assert b.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert [o.request_id for o in b.offenders] == [o.request_id for o in a.offenders]


    def test_outside_alarms_are_logged_and_halt(self, tmp_path):
        """An alarm found outside the Monitor (the engine guard's) is logged and halts under the policy;
        a wrong step or a non-Alarm is an InputError."""
        from rlcheck.core.detect import Alarm

        mon = monitor(tmp_path)
        rng = np.random.default_rng(0)
        mon.observe(0, ragged(rng))
        with pytest.raises(InputError, match="step 5"):
            mon.observe(1, ragged(rng), alarms=[Alarm("signature", "guard/violations", 5, "critical", "x")])
        with pytest.raises(InputError, match="Alarm objects"):
            mon.observe(1, ragged(rng), alarms=[{"kind": "signature"}])
        guard = Alarm("signature", "guard/violations", 2, "critical", "engine guard: slot shared", {"signature": "engine_guard"})
        with pytest.raises(MismatchHalt) as info:
            mon.observe(2, ragged(rng), alarms=[guard])
        assert info.value.report.alarms == [guard] and "slot shared" in info.value.reason
        last = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
        assert last["step"] == 2 and last["alarms"][0]["details"]["signature"] == "engine_guard"


class TestRunDirectory:
    def test_state_saved_atomically_every_step(self, tmp_path):
        """state.json is whole JSON after each step and no temporary file is left behind."""
        mon = monitor(tmp_path)
        rng = np.random.default_rng(0)
        for step in range(3):
            mon.observe(step, ragged(rng))
            state = json.loads((tmp_path / "run" / "state.json").read_text())
            assert state["last_step"] == step
        assert sorted(os.listdir(tmp_path / "run")) == [".lock", "metrics.jsonl", "state.json"]

    def test_resume_continues_detectors(self, tmp_path):
        """Two monitors over one run dir (150 steps each) raise the alarms one monitor raises over 300."""
        cfg = SyntheticConfig(num_sequences=16, mean_length=30, spike_every=7, spike_phase=3, spike_start=150,
                              spike_scale=1.6)
        halt = HaltConfig(enabled=False)

        def alarms(mon, steps):
            with mon:
                return [(s, a.kind, a.metric) for s in steps for a in mon.observe(s, synthetic_batch(cfg, s)).alarms]

        one = alarms(Monitor(MonitorConfig(run_dir=tmp_path / "one", sinks=(), halt=halt)), range(300))
        first = alarms(Monitor(MonitorConfig(run_dir=tmp_path / "two", sinks=(), halt=halt)), range(150))
        with pytest.warns(UserWarning, match="resume after step 149"):
            second = alarms(Monitor(MonitorConfig(run_dir=tmp_path / "two", sinks=(), halt=halt)), range(150, 300))
        assert any(kind == "periodic" for _, kind, _ in one)
        assert first + second == one

    def test_refuses_to_overwrite_without_resume(self, tmp_path):
        """resume=False on a run dir that holds a run is refused; the old run is untouched."""
        monitor(tmp_path).observe(0, ragged(np.random.default_rng(0)))
        before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
        with pytest.raises(RunDirError, match="resume"):
            monitor(tmp_path, resume=False)
        assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before

    def test_unwritable_run_dir_reported_at_start(self, tmp_path):
        """A run dir that cannot be created is a RunDirError from the constructor, not from step 500."""
        (tmp_path / "file").write_text("x")
        with pytest.raises(RunDirError, match="not writable"):
            Monitor(MonitorConfig(run_dir=tmp_path / "file" / "run", sinks=("jsonl",)))

    def test_corrupt_state_is_a_clear_error(self, tmp_path):
        """An unreadable state.json names the file and the way out."""
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "state.json").write_text("{not json")
        with pytest.raises(RunDirError, match="move it away"):
            monitor(tmp_path)

    def test_on_demand_dump_round_trip(self, tmp_path):
        """Monitor.dump writes a parquet + JSON dump that read_dump returns intact."""
        mon = monitor(tmp_path, context={"model": "tiny"})
        batch = synthetic_batch(SMALL, 3)
        report = mon.observe(3, batch)
        rows, meta = read_dump(mon.dump(3, batch, report))
        assert [r["request_id"] for r in rows] == list(batch.request_ids)
        np.testing.assert_array_equal(rows[5]["logp_train"], batch.logp_train[batch.cu_seqlens[5]:batch.cu_seqlens[6]])
        assert rows[5]["response_tokens"].tolist() == batch.tokens[batch.cu_seqlens[5]:batch.cu_seqlens[6]].tolist()
        assert meta["step"] == 3 and meta["context"] == {"model": "tiny"} and "numpy" in meta["versions"]


class TestHalt:
    def test_catastrophic_mismatch_halts_with_evidence(self, tmp_path):
        """Mean |d| past the hard limit halts; the JSONL line, state and dump exist when the exception arrives."""
        mon = monitor(tmp_path)
        rng = np.random.default_rng(0)
        mon.observe(0, ragged(rng))
        with pytest.raises(MismatchHalt) as info:
            mon.observe(1, ragged(rng, shift=-2.0, ids_prefix="bad"))
        halt = info.value
        assert isinstance(halt, RLCheckError) and halt.report.step == 1 and halt.report.halted
        assert "hard limit" in halt.reason
        rows, meta = read_dump(halt.dump_dir)
        assert meta["step"] == 1 and any(a["details"].get("hard_limit") for a in meta["alarms"])
        assert rows[0]["request_id"] == "bad0"
        assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1]
        assert json.loads((tmp_path / "run" / "state.json").read_text())["last_step"] == 1

    def test_nonfinite_halts(self, tmp_path):
        """A NaN trainer logprob halts by default and names the sequence."""
        rng = np.random.default_rng(0)
        b = ragged(rng)
        lt = b.logp_train.copy()
        lt[b.cu_seqlens[3] + 4] = np.nan
        b = StepBatch.from_packed(b.logp_rollout, lt, b.cu_seqlens, b.request_ids)
        with pytest.raises(MismatchHalt, match="nonfinite") as info:
            monitor(tmp_path).observe(0, b)
        top = info.value.report.offenders[0]
        assert (top.request_id, top.nonfinite, top.first_divergence) == ("r3", True, 4)

    def test_patience(self, tmp_path):
        """With patience 2 a critical alarm halts only on its second consecutive step."""
        sig = SignatureConfig(severity={"early_divergence": "critical"})
        mon = monitor(tmp_path, halt=HaltConfig(patience=2), detectors=DetectorsConfig(signature=sig))
        cfg = SyntheticConfig(num_sequences=100, mean_length=30, corrupt_every_step=1)
        assert mon.observe(0, synthetic_batch(cfg, 0)).alarms
        with pytest.raises(MismatchHalt):
            mon.observe(1, synthetic_batch(cfg, 1))

    def test_disabled_and_filtered(self, tmp_path):
        """enabled=False never halts; kinds without the alarm's kind do not halt on it."""
        rng = np.random.default_rng(0)
        report = monitor(tmp_path, halt=HaltConfig(enabled=False)).observe(0, ragged(rng, shift=-2.0))
        assert not report.halted and report.alarms
        sig = SignatureConfig(severity={"early_divergence": "critical"})
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "k", sinks=(), detectors=DetectorsConfig(signature=sig),
                                    halt=HaltConfig(kinds=("periodic",))))
        cfg = SyntheticConfig(num_sequences=100, mean_length=30, corrupt_every_step=1)
        assert not mon.observe(0, synthetic_batch(cfg, 0)).halted

    def test_one_corrupt_sequence_in_1000(self, tmp_path):
        """One stale-state sequence in 1,000 is flagged that step (its id first among offenders) without halting,
        while mean |d| and NeMo-RL's mean exp|d| barely move."""
        clean_cfg = SyntheticConfig(num_sequences=1000, mean_length=60, seed=4)
        bad_cfg = SyntheticConfig(num_sequences=1000, mean_length=60, seed=4, corrupt_every_step=1)
        clean = Monitor(MonitorConfig(run_dir=tmp_path / "c", sinks=())).observe(0, synthetic_batch(clean_cfg, 0))
        report = monitor(tmp_path).observe(0, synthetic_batch(bad_cfg, 0))
        assert not report.halted
        (alarm,) = [a for a in report.alarms if a.kind == "signature"]
        assert alarm.details["signature"] == "early_divergence"
        top = report.offenders[0]
        assert top.first_divergence == 0 and top.max_abs_diff >= 2.0
        assert report.offenders[1].max_abs_diff < 0.5
        assert report.metrics[K.ABS_DIFF_MEAN] - clean.metrics[K.ABS_DIFF_MEAN] < 0.01
        assert report.metrics[K.MULT_PROB_ERROR] < 1.05

    def test_halt_config_validation(self):
        """Bad halt settings are ValueErrors naming the field."""
        with pytest.raises(ValueError, match="patience"):
            HaltConfig(patience=0)
        with pytest.raises(ValueError, match="kinds"):
            HaltConfig(kinds=("sometimes",))


def nan_batch(rng, where=4):
    """`ragged` with one NaN trainer logprob in sequence 3."""
    b = ragged(rng)
    lt = b.logp_train.copy()
    lt[b.cu_seqlens[3] + where] = np.nan
    return StepBatch.from_packed(b.logp_rollout, lt, b.cu_seqlens, b.request_ids)


class TestHardLimitsWithoutHalt:
    def test_alarms_raised_and_logged_without_halt(self, tmp_path):
        """With halting off, a hard limit crossed is still a critical alarm, logged with the same
        details it has when halting is on; only the halt is skipped."""
        rng = np.random.default_rng(0)
        bad = ragged(rng, shift=-2.0)
        on = None
        with pytest.raises(MismatchHalt) as info:
            monitor(tmp_path / "on").observe(0, bad)
        on = [a for a in info.value.report.alarms if a.details.get("hard_limit")]
        with monitor(tmp_path / "off", halt=HaltConfig(enabled=False)) as mon:
            report = mon.observe(0, bad)
        off = [a for a in report.alarms if a.details.get("hard_limit")]
        assert not report.halted and off and [a.to_dict() for a in off] == [a.to_dict() for a in on]
        assert all(a.severity == "critical" for a in off)
        logged = read_jsonl(tmp_path / "off" / "run" / "metrics.jsonl")[0]["alarms"]
        assert {a["metric"] for a in logged if a["details"].get("hard_limit")} == {a.metric for a in off}


class TestNonfiniteAlwaysAlarms:
    @pytest.mark.parametrize("limits", [None, {}, {K.NONFINITE_COUNT: 5.0}, {K.ABS_DIFF_MEAN: 1.0}])
    def test_nan_halts_whatever_the_hard_limits(self, tmp_path, limits):
        """One NaN logprob halts (halting on) even when hard_limits omits it, is empty, or sets it above 1."""
        halt = HaltConfig() if limits is None else HaltConfig(hard_limits=limits)
        with monitor(tmp_path, halt=halt) as mon, pytest.raises(MismatchHalt, match="nonfinite") as info:
            mon.observe(0, nan_batch(np.random.default_rng(0)))
        (alarm,) = [a for a in info.value.report.alarms if a.metric == K.NONFINITE_COUNT]
        assert alarm.severity == "critical" and alarm.details["value"] == 1.0

    @pytest.mark.parametrize("limits", [None, {}])
    def test_nan_alarms_with_halting_off(self, tmp_path, limits):
        """With halting off, a NaN logprob is still one critical alarm, in the report and in metrics.jsonl."""
        halt = HaltConfig(enabled=False) if limits is None else HaltConfig(enabled=False, hard_limits=limits)
        with monitor(tmp_path, halt=halt) as mon:
            mon.observe(0, ragged(np.random.default_rng(1)))
            report = mon.observe(1, nan_batch(np.random.default_rng(0)))
        assert not report.halted
        assert [(a.metric, a.severity) for a in report.alarms if a.metric == K.NONFINITE_COUNT] == [
            (K.NONFINITE_COUNT, "critical")]
        logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [a["metric"] for a in logged[0]["alarms"]] == []
        assert [a["metric"] for a in logged[1]["alarms"]].count(K.NONFINITE_COUNT) == 1

    @pytest.mark.parametrize("value", [float("nan"), float("inf")])
    def test_non_finite_metric_is_past_its_hard_limit(self, tmp_path, value):
        """A hard-limited metric that is NaN (or infinite) is past its limit: `value > limit` read NaN as within."""
        halt = HaltConfig(enabled=False, hard_limits={"sync/probe_mean_abs": 0.1})
        with monitor(tmp_path, halt=halt) as mon:
            report = mon.observe(0, ragged(np.random.default_rng(1)), extra={"sync/probe_mean_abs": value})
        (alarm,) = [a for a in report.alarms if a.metric == "sync/probe_mean_abs"]
        assert alarm.severity == "critical" and alarm.details["hard_limit"]

    def test_negative_limit_keeps_its_meaning(self, tmp_path):
        """A hard limit below 0 on the count still fires on a clean step, as any hard-limit entry does."""
        halt = HaltConfig(enabled=False, hard_limits={K.NONFINITE_COUNT: -1.0})
        with monitor(tmp_path, halt=halt) as mon:
            report = mon.observe(0, ragged(np.random.default_rng(1)))
        assert [a.details["limit"] for a in report.alarms if a.metric == K.NONFINITE_COUNT] == [-1.0]


def masked_batch(rng, n=3, length=6):
    """`n` sequences of `length` tokens, every one masked out (TRL's mask_truncated_completions)."""
    lr = [-rng.exponential(1.0, length) for _ in range(n)]
    lt = [np.minimum(x + 0.3, 0.0) for x in lr]
    return StepBatch.from_ragged(lr, lt, [f"m{i}" for i in range(n)], mask=[np.zeros(length, bool)] * n)


class TestEmptyStep:
    def _check_empty(self, tmp_path, observe_empty, num_sequences):
        """Steps 0-1 clean, step 2 empty (warned, logged as empty, counts only, detectors skipped), step 3 clean."""
        rng = np.random.default_rng(2)
        with monitor(tmp_path) as mon:
            for s in range(2):
                mon.observe(s, ragged(rng))
            before = json.loads(json.dumps(mon.state_dict()["detectors"]))
            with pytest.warns(UserWarning, match="step 2 .*no token"):
                report = observe_empty(mon, 2)
            assert not report.halted and report.alarms == []
            assert json.loads(json.dumps(mon.state_dict()["detectors"])) == before
            mon.observe(3, ragged(rng))
        records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        empty = records[2]
        assert empty.get("empty") is True and all(r.get("empty") is None for r in (records[1], records[3]))
        assert empty["metrics"][K.TOKEN_COUNT] == 0 and empty["metrics"][K.SEQ_COUNT] == num_sequences
        assert K.ABS_DIFF_MEAN not in empty["metrics"] and empty["alarms"] == []

    def test_every_token_masked(self, tmp_path):
        """observe of a batch whose mask excludes every token."""
        self._check_empty(tmp_path, lambda mon, s: mon.observe(s, masked_batch(np.random.default_rng(0))), 3)

    def test_every_row_masked_padded(self, tmp_path):
        """observe of [B, T] tensors whose completion mask is all zero (every sequence empty, no token)."""
        z = -np.ones((2, 5))
        batch = StepBatch.from_padded(z, z - 0.5, np.zeros((2, 5), dtype=bool), ["a", "b"])
        self._check_empty(tmp_path, lambda mon, s: mon.observe(s, batch), 2)

    def test_observe_partial_of_no_sequence(self, tmp_path):
        """observe_partial of statistics with no sequence at all (every rank empty)."""
        from rlcheck.core.stats import empty_partial

        self._check_empty(tmp_path, lambda mon, s: mon.observe_partial(s, empty_partial()), 0)

    def test_observe_partial_of_masked_ranks(self, tmp_path):
        """observe_partial of two ranks' merged statistics, every token masked on both."""
        rng = np.random.default_rng(0)
        parts = [compute_partial(masked_batch(rng)), compute_partial(masked_batch(rng))]
        self._check_empty(tmp_path, lambda mon, s: mon.observe_partial(s, merge(parts)), 6)

    def test_empty_step_dump(self, tmp_path):
        """A halt from outside alarms on an empty step still writes its dump."""
        from rlcheck.core.detect import Alarm

        guard = Alarm("signature", "guard/violations", 0, "critical", "engine guard: slot shared")
        z = -np.ones((2, 5))
        batch = StepBatch.from_padded(z, z.copy(), np.zeros((2, 5), dtype=bool), ["a", "b"])
        with monitor(tmp_path) as mon, pytest.warns(UserWarning, match="no token"), \
                pytest.raises(MismatchHalt) as info:
            mon.observe(0, batch, alarms=[guard])
        rows, meta = read_dump(info.value.dump_dir)
        assert [r["length"] for r in rows] == [0, 0] and meta["reason"] == info.value.reason


class TestOneLiveMonitor:
    def test_second_live_monitor_refused(self, tmp_path):
        """A second live Monitor on a run dir is a RunDirError naming this process; the first goes on
        and nothing of the second reached the run dir."""
        rng = np.random.default_rng(0)
        first = monitor(tmp_path)
        first.observe(0, ragged(rng))
        with pytest.raises(RunDirError, match=rf"pid {os.getpid()}.*close"):
            monitor(tmp_path)
        first.observe(1, ragged(rng))
        first.close()
        assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1]

    def test_a_halt_releases_the_run(self, tmp_path):
        """After MismatchHalt the halted Monitor holds no lock: a new Monitor on the same run dir in the
        same process (a notebook cell run again) opens it, with the halt's journal and dump on disk."""
        rng = np.random.default_rng(0)
        mon = monitor(tmp_path)
        mon.observe(0, ragged(rng))
        with pytest.raises(MismatchHalt) as info:
            mon.observe(1, ragged(rng, shift=-2.0, ids_prefix="bad"))
        assert info.value.problems == () and info.value.dump_dir is not None
        with pytest.warns(UserWarning, match="resum"), monitor(tmp_path) as again:
            assert again.last_step == 1
        mon.close()  # closing the halted Monitor again does nothing more
        assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1]

    def test_close_and_exit_release(self, tmp_path):
        """close() and leaving a `with` block let the next Monitor open the run dir; close twice is fine."""
        mon = monitor(tmp_path)
        mon.close()
        mon.close()
        with monitor(tmp_path):
            pass
        monitor(tmp_path).close()

    def test_failed_constructor_releases(self, tmp_path):
        """A Monitor refused after taking the lock (resume=False on a run) leaves the run dir free."""
        with monitor(tmp_path) as mon:
            mon.observe(0, ragged(np.random.default_rng(0)))
        with pytest.raises(RunDirError, match="resume=True"):
            monitor(tmp_path, resume=False)
        with pytest.warns(UserWarning, match="resum"):
            monitor(tmp_path).close()

    def test_resumed_run_says_so(self, tmp_path):
        """A resumed Monitor warns naming the step it resumes after; state.json counts the resumes and
        the first record each resumed Monitor writes carries the resume, later ones do not."""
        rng = np.random.default_rng(0)
        with monitor(tmp_path) as mon:
            mon.observe(0, ragged(rng))
            mon.observe(1, ragged(rng))
        assert "resumes" not in read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
        for n, step in ((1, 2), (2, 4)):
            with pytest.warns(UserWarning, match=rf"resuming .*resume {n}\b.*after step {step - 1}"), \
                    monitor(tmp_path) as mon:
                mon.observe(step, ragged(rng))
                mon.observe(step + 1, ragged(rng))
            assert json.loads((tmp_path / "run" / "state.json").read_text())["resumes"] == n
        records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [r.get("resumed") for r in records] == [
            None, None, {"after_step": 1, "count": 1}, None, {"after_step": 3, "count": 2}, None]
