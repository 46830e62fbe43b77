"""The field stream model and its scenarios: the stream is what it says, and the default Monitor holds
on it (healthy runs: no halt, warn on at most 0.5% of steps; faults: caught). Seeds are TEST_SEEDS,
never the ones the defaults were set on (CALIBRATION_SEEDS) or the benchmark's (HELD_OUT_SEEDS)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.stats import compute
from rlcheck.errors import ConfigError
from rlcheck.synthetic import FieldConfig, FieldFault, FieldStream
from rlcheck.synthetic.scenarios import (
    CALIBRATION_SEEDS,
    FAULTS,
    HELD_OUT_SEEDS,
    SCENARIOS,
    TEST_SEEDS,
    observation_order,
    run_scenario,
)

SEED = TEST_SEEDS[0]


class TestFieldStream:
    def test_deterministic_per_seed_and_observation(self):
        """The same (seed, observation) gives the same batch; another seed another."""
        a, b = FieldStream(FieldConfig(seed=SEED), num_steps=10), FieldStream(FieldConfig(seed=SEED), num_steps=10)
        c = FieldStream(FieldConfig(seed=SEED + 1), num_steps=10)
        np.testing.assert_array_equal(a.batches(3)[0].logp_train, b.batches(3)[0].logp_train)
        assert a.batches(3)[0].num_tokens != c.batches(3)[0].num_tokens

    def test_level_follows_the_floor(self):
        """Mean |d| sits at the floor (within the step wobble) and grows with it."""
        cfg = FieldConfig(num_sequences=32, median_length=400, growth=10.0, growth_steps=1000, seed=SEED)
        stream = FieldStream(cfg, num_steps=1001)
        early = np.median([compute(stream.batches(i)[0])[0][K.ABS_DIFF_MEAN] for i in range(0, 40)])
        late = np.median([compute(stream.batches(i)[0])[0][K.ABS_DIFF_MEAN] for i in range(960, 1000)])
        assert 0.6e-3 < early < 1.6e-3
        assert 6 < late / early < 16

    def test_strides_ranks_and_lengths(self):
        """Observation i is step i * stride; one batch per rank; lengths capped at max_length."""
        cfg = FieldConfig(num_ranks=2, step_stride=2, median_length=20_000, max_length=32_768, seed=SEED)
        stream = FieldStream(cfg, num_steps=5)
        batches = stream.batches(4)
        assert stream.step(4) == 8 and len(batches) == 2
        assert max(b.seq_lens.max() for b in batches) <= 32_768
        assert batches[0].request_ids[0].startswith("r0-s8") and batches[1].request_ids[0].startswith("r1-s8")

    def test_corrupt_sequences_are_ground_truth(self):
        """corrupt-seqs touches an observation only when one of its sequences drew the fault; those
        sequences are catastrophic by the statistics' rate-of-tokens rule, the rest are not."""
        fault = FieldFault("corrupt-seqs", onset=0, value=0.05)
        stream = FieldStream(FieldConfig(seed=SEED), fault, num_steps=20)
        cats = [compute(stream.batches(i)[0])[0][K.SEQ_CATASTROPHIC_COUNT] for i in range(20)]
        assert stream.touched and all((c > 0) == (i in stream.touched) for i, c in enumerate(cats))

    def test_bad_config_is_a_config_error(self):
        """Out-of-range settings raise ConfigError."""
        with pytest.raises(ConfigError):
            FieldConfig(tail_rate=1.5)
        with pytest.raises(ConfigError):
            FieldFault("nope")


class TestScenarios:
    def test_seed_sets_are_disjoint(self):
        """Calibration, benchmark and test seeds never overlap."""
        assert not set(CALIBRATION_SEEDS) & set(HELD_OUT_SEEDS) | set(CALIBRATION_SEEDS) & set(TEST_SEEDS)
        assert not set(HELD_OUT_SEEDS) & set(TEST_SEEDS)

    def test_observation_order_rewinds(self):
        """A restart resumes `rewind` observations back: those steps come again."""
        s = dataclasses.replace(SCENARIOS["resumed"], num_steps=12, restart_at=(8,), rewind=3)
        assert observation_order(s) == [0, 1, 2, 3, 4, 5, 6, 7, -1, 5, 6, 7, 8, 9, 10, 11]

    @pytest.mark.parametrize(("name", "steps"), [("bf16-short", 400), ("gapped", 300), ("two-ranks", 300)])
    def test_healthy_prefix_is_quiet(self, tmp_path, name, steps):
        """The first steps of a healthy scenario: no halt, no warning."""
        s = dataclasses.replace(SCENARIOS[name], num_steps=steps)
        r = run_scenario(s, SEED, tmp_path)
        assert r.halts == [] and r.warn_steps == 0
        assert len(r.steps) == steps and r.steps[1] - r.steps[0] == s.field.step_stride

    def test_resumed_run_continues(self, tmp_path):
        """Restarts with repeated steps: every observation recorded, no halt, no warning."""
        s = dataclasses.replace(SCENARIOS["resumed"], num_steps=300, restart_at=(150,), rewind=20)
        r = run_scenario(s, SEED, tmp_path)
        assert len(r.steps) == 320 and r.halts == [] and r.warn_steps == 0
        assert r.steps[150:152] == [130, 131]

    @pytest.mark.parametrize("fault", [f for f in FAULTS if f.kind in ("off-by-one", "corrupt-seqs", "stale-weights")],
                             ids=lambda f: f.name)
    def test_fault_halts(self, tmp_path, fault):
        """The zoo's critical faults on the short bf16 baseline halt; corrupt-seqs is alarmed on the
        first observation it touched."""
        s = dataclasses.replace(SCENARIOS["bf16-short"], num_steps=fault.onset + 150)
        r = run_scenario(s, SEED, tmp_path, fault=fault, stop_on_halt=True)
        on = r.onset_observation
        assert on is not None and r.first_alarm(0) is not None and r.first_alarm(0) >= on
        assert r.halts and r.halts[0] >= on
        if fault.kind == "corrupt-seqs":
            assert r.first_alarm(0) == on

    def test_a_run_goes_on_after_its_halts(self, tmp_path):
        """Without stop_on_halt the harness counts every halt and keeps observing: each halt closed
        its run, and a new Monitor resumes it as a restarted trainer would."""
        fault = next(f for f in FAULTS if f.kind == "off-by-one")
        s = dataclasses.replace(SCENARIOS["bf16-short"], num_steps=fault.onset + 6)
        r = run_scenario(s, SEED, tmp_path, fault=fault)
        assert len(r.halts) >= 2 and len(r.steps) == s.num_steps
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == s.num_steps  # every step journaled
