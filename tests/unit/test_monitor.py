"""Monitor: the public API, logging, state and resume, the halt policy and its evidence."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rlcheck import HaltConfig, MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck import metrics as K
from rlcheck.detect import DetectorsConfig, SignatureConfig
from rlcheck.dump import read_dump
from rlcheck.errors import InputError, RLCheckError, RunDirError
from rlcheck.sinks import read_jsonl
from rlcheck.stats import compute_partial, merge
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
        """Statistics merged from two halves give the same report as the whole batch."""
        batch = synthetic_batch(SMALL, 0)
        whole = Monitor(MonitorConfig(run_dir=tmp_path / "a", sinks=())).observe(0, batch)
        halves = [compute_partial(batch.select(range(0, 12))), compute_partial(batch.select(range(12, 24)))]
        merged = Monitor(MonitorConfig(run_dir=tmp_path / "b", sinks=())).observe_partial(0, merge(halves))
        for key, value in whole.metrics.items():
            if key != K.MONITOR_SECONDS:
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
        from rlcheck.detect import Alarm

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
        assert sorted(os.listdir(tmp_path / "run")) == ["metrics.jsonl", "state.json"]

    def test_resume_continues_detectors(self, tmp_path):
        """Two monitors over one run dir (150 steps each) raise the alarms one monitor raises over 300."""
        cfg = SyntheticConfig(num_sequences=16, mean_length=30, spike_every=7, spike_phase=3, spike_start=150,
                              spike_scale=1.6)
        halt = HaltConfig(enabled=False)

        def alarms(mon, steps):
            return [(s, a.kind, a.metric) for s in steps for a in mon.observe(s, synthetic_batch(cfg, s)).alarms]

        one = alarms(Monitor(MonitorConfig(run_dir=tmp_path / "one", sinks=(), halt=halt)), range(300))
        first = alarms(Monitor(MonitorConfig(run_dir=tmp_path / "two", sinks=(), halt=halt)), range(150))
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
        assert rows[5]["response_tokens"] == batch.tokens[batch.cu_seqlens[5]:batch.cu_seqlens[6]].tolist()
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
