"""The multi-turn faults (`rlcheck.faults.turns`) on synthetic multi-turn streams (`rlcheck.synthetic.turns`),
and `rlcheck diagnose` naming each one's cause (`rlcheck.forensics.diagnose.rules.turns`): the batch-level
rows of the confusion matrix, with and without the engine's per-call prompts."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.errors import ConfigError, MismatchHalt
from rlcheck.faults import FAULTS, parse_inject
from rlcheck.faults.turns import TURN_FAULTS
from rlcheck.forensics.diagnose import CAUSES, diagnose
from rlcheck.synthetic.field import FieldConfig
from rlcheck.synthetic.turns import MultiTurnConfig, MultiTurnStream

SMALL = MultiTurnConfig(field=FieldConfig(num_sequences=8, seed=11), first_length=80, turn_length=16,
                        observation_length=10)


def run_and_diagnose(tmp_path, fault, mask_runs: bool = False, steps: int = 5, seed: int = 11) -> str:
    cfg = dataclasses.replace(SMALL, mask_runs=mask_runs, field=dataclasses.replace(SMALL.field, seed=seed))
    stream = MultiTurnStream(cfg, fault=fault, num_steps=steps)
    run_dir = tmp_path / f"{fault.name if fault else 'healthy'}-{mask_runs}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = Monitor(MonitorConfig(run_dir, sinks=(), quarantine=QuarantineConfig(max_frac=0.9)))
        try:
            for i in range(steps):
                mon.observe(i, stream.batch(i), trainer_version=stream.trainer_version(i))
        except MismatchHalt:
            pass
        mon.close()
    return diagnose(run_dir).verdict.cause


class TestFaults:
    def test_registered(self):
        """Every multi-turn fault parses from its name, and names a cause diagnose knows."""
        for cls in TURN_FAULTS:
            assert type(parse_inject(f"{cls.name}@3")) is cls and FAULTS[cls.name][0] is cls
            assert cls.cause in CAUSES

    def test_needs_turns(self):
        """A multi-turn fault on a batch without turns says so."""
        batch = MultiTurnStream(SMALL, num_steps=2).batch(0)
        with pytest.raises(ConfigError, match="no turns"):
            TURN_FAULTS[0]().apply(0, dataclasses.replace(batch, turns=None))

    def test_start_and_touched(self):
        """Before its start a fault leaves the batch alone; after, it names the sequences it touched."""
        batch = MultiTurnStream(SMALL, num_steps=2).batch(0)
        same, touched = TURN_FAULTS[0](start=5).apply(1, batch)
        assert same is batch and touched == []
        changed, touched = TURN_FAULTS[0](rate=0.5, seed=2).apply(5, batch)
        assert 0 < len(touched) < batch.num_sequences
        counts = batch.turns.turn_counts(batch.cu_seqlens)
        assert all(counts[batch.request_ids.index(r)] >= 2 for r in touched)
        assert not np.array_equal(changed.logp_rollout, batch.logp_rollout)


class TestDiagnose:
    @pytest.mark.parametrize("cls", TURN_FAULTS, ids=lambda c: c.name)
    def test_names_the_cause_with_per_call_prompts(self, tmp_path, cls):
        """With the engine's per-call prompts (own loop, verifiers, SkyRL): every fault named right."""
        assert run_and_diagnose(tmp_path, cls(start=2)) == cls.cause

    @pytest.mark.parametrize("cls", TURN_FAULTS, ids=lambda c: c.name)
    def test_names_the_cause_from_mask_runs(self, tmp_path, cls):
        """Turns from mask runs alone (verl, TRL): named right, but stripped history, which without the
        engine's prompts reads as re-tokenized history (the finding says it cannot tell them apart)."""
        expected = "retokenized_history" if cls.cause == "stripped_history" else cls.cause
        assert run_and_diagnose(tmp_path, cls(start=2), mask_runs=True) == expected

    def test_healthy(self, tmp_path):
        assert run_and_diagnose(tmp_path, None, steps=12) == "healthy"

    def test_turn_shape_outranks_position(self, tmp_path):
        """Later turns sit at later positions: a fault confined to turns >= 1 (mask runs only, the bench's
        seed 1, where the dump's |d| rises with the position) is still named for the turns."""
        cls = TURN_FAULTS[0]
        cfg = MultiTurnConfig(field=FieldConfig(num_sequences=16, seed=1), mask_runs=True)
        stream = MultiTurnStream(cfg, fault=cls(start=100, seed=1), num_steps=106)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mon = Monitor(MonitorConfig(tmp_path / "r", sinks=(), quarantine=QuarantineConfig(max_frac=0.9)))
            try:
                for i in range(106):
                    mon.observe(i, stream.batch(i), trainer_version=stream.trainer_version(i))
            except MismatchHalt:
                pass
            mon.close()
        assert diagnose(tmp_path / "r").verdict.cause == cls.cause
