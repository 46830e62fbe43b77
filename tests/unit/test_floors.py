"""The floor of a run's precision pair (`rlcheck.core.floors`) and the Monitor judging a run by it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.floors import Floor, Precision, dtype_name
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import ConfigError


def step_batch(level: float, seed: int = 0, n: int = 64, length: int = 32, probs=(0.3, 0.9)) -> StepBatch:
    """n sequences whose |d| averages about `level` on tokens of probability `probs` (kept under 1)."""
    rng = np.random.default_rng(seed)
    lr = [np.log(rng.uniform(*probs, length)) for _ in range(n)]
    lt = [np.minimum(x + rng.choice([-1.0, 1.0], length) * rng.exponential(level, length), -1e-6) for x in lr]
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=[f"r{i}" for i in range(n)])


def run(tmp_path, levels, **cfg) -> list[list]:
    with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=(), **cfg)) as mon:
        return [mon.observe(s, step_batch(x, seed=s)).alarms for s, x in enumerate(levels)]


class TestPrecision:
    @pytest.mark.parametrize("given, name", [("bf16", "bfloat16"), ("torch.float32", "float32"), ("half", "float16"),
                                             ("auto", None), (None, None), ("FP32", "float32")])
    def test_dtype_names(self, given, name):
        """dtype spellings of torch, vLLM and the configs map to one name; "auto" is unknown."""
        assert dtype_name(given) == name

    def test_unknown_dtype_is_refused(self):
        with pytest.raises(ConfigError, match="unknown precision"):
            Precision(engine="int8")

    def test_the_lower_precision_decides(self):
        """The pair sits at its coarser side's floor; one unknown side leaves it unknown unless the known
        one is bf16 (nothing is coarser)."""
        assert Precision("float32", "float32").level == 1e-5
        assert Precision("bfloat16", "float32").level == Precision("float32", "bfloat16").level == 1e-2
        assert Precision("bfloat16", None).level == 1e-2 and Precision("float32", None).level is None

    @pytest.mark.parametrize("context, pair", [
        ({"engine": {"dtype": "float32"}, "trainer": {"dtype": "float32"}}, ("float32", "float32")),  # the loop's
        ({"vllm_dtype": "bfloat16", "trainer_bf16": False}, ("bfloat16", None)),  # TRL's
        ({"vllm_dtype": "float32", "trainer_fp16": True}, ("float32", "float16")),
        ({"precision": {"engine": "bf16", "trainer": "fp32"}}, ("bfloat16", "float32")),
        ({"engine": {"dtype": "fp8"}}, (None, None)),  # a dtype rlcheck does not know: calibrate
        ({"engine": "vllm", "trainer": "none", "precision": "bf16"}, (None, None)),  # a stress dump's strings
        ({}, (None, None)),
    ])
    def test_from_context(self, context, pair):
        p = Precision.from_context(context)
        assert (p.engine, p.trainer) == pair

    @pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
    def test_the_loops_own_context(self, engine_dtype):
        """`LoopConfig.context()` as the loop hands it to its Monitor, before the engine says the dtype it ran
        (engine.dtype None, engine.configured_dtype set): the configured dtype decides (a fp32 loop read as
        unknown calibrated on a fault present from step 0: rope-mismatch went unalarmed)."""
        from rlcheck.loop.presets import tiny_cpu

        p = Precision.from_context(tiny_cpu("runs/models/llama", trainer="hf", engine_dtype=engine_dtype).context())
        assert (p.engine, p.trainer) == (engine_dtype, "float32")
        auto = Precision.from_context({"engine": {"dtype": None, "configured_dtype": "auto"}, "trainer": {"dtype": "float32"}})
        assert auto.engine is None


class TestFloorCalibration:
    def test_a_precise_run_calibrates_to_fp32(self):
        """Unknown dtypes: bf16 scale until calibration_steps observations, then the fp32 floor when the
        lowest of them sits at fp32 noise; the record carries the level in effect."""
        floor = Floor(Precision())
        seen = []
        for x in (3e-7, 2e-2, 1e-6, 5e-7):
            m = {K.ABS_DIFF_CLIPPED_MEAN: x}
            floor.observe(m)
            seen.append((m[K.FLOOR_LEVEL], m[K.FLOOR_SCALE]))
        assert seen[:3] == [(1e-2, 1.0)] * 3 and seen[3] == (1e-5, pytest.approx(1e-3))

    def test_a_bf16_run_stays_at_bf16_and_empty_steps_do_not_count(self):
        floor = Floor(Precision(calibration_steps=2))
        floor.observe({K.ABS_DIFF_CLIPPED_MEAN: 1e-9}, empty=True)
        for x in (3e-3, 5e-3):
            floor.observe({K.ABS_DIFF_CLIPPED_MEAN: x})
        assert floor.calibrated and floor.level == 1e-2

    def test_known_dtypes_ignore_a_calibrating_state(self):
        """A state saved while calibrating does not override dtypes given now; an unknown-dtype floor resumes it."""
        state = json.loads(json.dumps({"level": 1e-3, "seen": [1e-4] * 4, "calibrated": True}))
        known = Floor(Precision("float32", "float32"))
        known.load_state_dict(state)
        unknown = Floor(Precision())
        unknown.load_state_dict(state)
        assert known.level == 1e-5 and unknown.level == 1e-3 and unknown.calibrated


class TestMonitorAtTheFloor:
    def test_fp32_far_above_its_floor_alarms_bf16_at_its_level_does_not(self, tmp_path):
        """A fp32/fp32 run at 1e-2 (10^4 x its floor) raises the threshold gates at once; a bf16 run at its
        usual 5e-3 raises nothing, nor a fp32 one at 1e-6."""
        fp32 = Precision("float32", "float32")
        first = run(tmp_path / "a", [1e-2], precision=fp32)[0]
        assert {a.metric for a in first} >= {K.ABS_DIFF_CLIPPED_MEAN, K.PROB_ABS_DIFF_MEAN}
        assert all(a.details["limit"] <= 5e-5 for a in first if a.kind == "threshold")
        assert run(tmp_path / "b", [5e-3] * 6, precision=Precision("bfloat16", "float32")) == [[]] * 6
        assert run(tmp_path / "c", [1e-6] * 6, precision=fp32) == [[]] * 6

    def test_the_context_names_the_dtypes(self, tmp_path):
        """Without `precision`, the loop's context (engine and trainer dtypes) sets the floor."""
        ctx = {"engine": {"dtype": "float32"}, "trainer": {"dtype": "float32"}}
        assert run(tmp_path, [1e-2], context=ctx)[0]

    def test_plain_api_calibrates_then_judges(self, tmp_path):
        """Unknown dtypes: four fp32-level steps calibrate the floor; a step at 1e-2 after them alarms,
        and the record says the floor; a resumed Monitor keeps the calibration."""
        alarms = run(tmp_path, [1e-6] * 4 + [1e-2])
        assert alarms[:4] == [[]] * 4 and alarms[4]
        records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["metrics"][K.FLOOR_LEVEL] for r in records] == [1e-2] * 3 + [1e-5] * 2
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=())) as mon:
            assert mon.floor.level == 1e-5 and mon.detectors["threshold"].scale == pytest.approx(1e-3)


class TestMeasuredFloor:
    """A floor the trainer measured (`Floor.observe(sample=)`, `Monitor.observe(floor_sample=)`): its own
    forward at the engine's precision against its own logprobs, the model's noise at that precision."""

    def test_a_sample_above_the_level_judges_that_step_only(self):
        """The step is judged at the sample where it is above the pair's level, the next step without one at
        the level again; a sample under the level changes nothing; the twin bar keeps the level's."""
        from rlcheck.core.detect.threshold import ThresholdDetector
        from rlcheck.core.stats import StatsConfig

        det = ThresholdDetector()
        floor = Floor(Precision("bfloat16", "float32"), {"threshold": det})
        m = {K.ABS_DIFF_CLIPPED_MEAN: 0.05}
        floor.observe(m, sample=0.03)  # the record: the precision's level, and the sample beside it
        assert (m[K.FLOOR_LEVEL], m[K.FLOOR_SCALE], m[K.FLOOR_MEASURED]) == (1e-2, 1.0, 0.03)
        assert det.scale == pytest.approx(3.0) and floor.current == 0.03
        assert floor.stats(StatsConfig()).twin_tau == StatsConfig().twin_tau
        m = {K.ABS_DIFF_CLIPPED_MEAN: 0.05}
        floor.observe(m)
        assert (m[K.FLOOR_LEVEL], K.FLOOR_MEASURED in m, det.scale) == (1e-2, False, 1.0)
        floor.observe(m := {}, sample=2e-3)
        assert m[K.FLOOR_MEASURED] == 2e-3 and det.scale == 1.0

    def test_the_excess_over_the_measure(self):
        """`floor/excess`: the step's clipped mean over the level it is judged at (the sample where above the
        precision's level, else the level); not logged on a step without a sample or without tokens."""
        floor = Floor(Precision("bfloat16", "float32"))
        floor.observe(m := {K.ABS_DIFF_CLIPPED_MEAN: 0.06}, sample=0.02)
        assert m[K.FLOOR_EXCESS] == pytest.approx(3.0)
        floor.observe(m := {K.ABS_DIFF_CLIPPED_MEAN: 0.02}, sample=2e-3)  # under the level: over the level
        assert m[K.FLOOR_EXCESS] == pytest.approx(2.0)
        floor.observe(m := {K.ABS_DIFF_CLIPPED_MEAN: 0.06})
        assert K.FLOOR_EXCESS not in m
        floor.observe(m := {K.ABS_DIFF_CLIPPED_MEAN: 0.06}, empty=True, sample=0.02)
        assert K.FLOOR_EXCESS not in m and m[K.FLOOR_MEASURED] == 0.02

    def test_the_excess_gate_is_read_on_a_dense_model_only(self, tmp_path):
        """A step 4x over its measured floor (0.08 against 0.02: under the clipped-mean gate's 5x, on unlikely
        tokens as a random model's, under the probability gate) warns where the context names a model that
        routes no experts, not on an MoE or where the context does not say."""
        def alarms(context):
            with Monitor(MonitorConfig(run_dir=tmp_path / str(len(list(tmp_path.iterdir()))), sinks=(),
                                       precision=Precision("bfloat16", "float32"), context=context)) as mon:
                quiet = mon.observe(0, step_batch(0.02, seed=0, probs=(0.01, 0.05)), floor_sample=0.02).alarms
                return quiet, mon.observe(1, step_batch(0.08, seed=1, probs=(0.01, 0.05)), floor_sample=0.02).alarms

        quiet, dense = alarms({"model_type": "llama", "experts": 0})
        assert quiet == [] and [a.metric for a in dense] == [K.FLOOR_EXCESS]
        assert "measure" in dense[0].message
        for context in ({"model_type": "qwen3_moe", "experts": 8}, {}):
            assert alarms(context) == ([], [])

    @pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
    def test_a_bad_sample_is_refused_before_anything_is_logged(self, tmp_path, bad):
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=())) as mon:
            with pytest.raises(ConfigError, match="floor_sample"):
                mon.observe(0, step_batch(5e-3), floor_sample=bad)
            mon.observe(0, step_batch(5e-3))
        assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1

    def test_measured_level(self):
        """Clipped mean |d| over every response token of every sequence; None without a token."""
        from rlcheck.core.floors import measured_level

        low = [np.array([-1.0, -2.0]), np.array([-0.5])]
        full = [np.array([-1.1, -2.0]), np.array([-1.5])]
        assert measured_level(low, full, clip=0.5) == pytest.approx((0.1 + 0.0 + 0.5) / 3)
        assert measured_level([], [], clip=0.5) is None
        with pytest.raises(ConfigError, match="floor sample"):
            measured_level(low, full[:1], clip=0.5)

    def test_a_noisy_model_at_its_measured_floor_does_not_alarm(self, tmp_path):
        """A bf16 run 3x the bf16 level (the tiny MoE's bf16 engine on an AVX512-BF16 CPU) alarms at the
        precision's level (failed before: the sample was not taken) and not at the floor its trainer measured;
        a fault 10x over that measured floor still alarms."""
        bf16 = MonitorConfig(run_dir=tmp_path / "a", sinks=(), precision=Precision("bfloat16", "float32"))
        levels = [0.03] * 6

        def alarms(cfg, samples, xs):
            with Monitor(cfg) as mon:
                return [mon.observe(s, step_batch(x, seed=s), floor_sample=f).alarms
                        for s, (x, f) in enumerate(zip(xs, samples, strict=True))]

        assert any(alarms(bf16, [None] * 6, levels))
        import dataclasses

        assert alarms(dataclasses.replace(bf16, run_dir=tmp_path / "b"), [0.03] * 6, levels) == [[]] * 6
        assert alarms(dataclasses.replace(bf16, run_dir=tmp_path / "c"), [0.03] * 6, [0.03] * 3 + [0.3] * 3)[3]
