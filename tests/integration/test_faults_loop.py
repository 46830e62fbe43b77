"""Every data-level fault injected into the real loop (vLLM, Ray, the hf trainer): the monitor catches it
once it acts (none before: the first 12 steps of each run are clean), and `diagnose` names its cause and
the requests it touched (a clean run's "healthy": tests/integration/test_loop.py, 40 steps).

To keep the runs short the robust-z detector warms up over 12 steps (the default is 32), and faults
that can start later start at step 12, when it is warm.
"""

from __future__ import annotations

import json

import pytest

from rlcheck.core.detect import DetectorsConfig, RobustZConfig
from rlcheck.forensics.diagnose import diagnose
from tests.loop_runs import alarm_steps, run_fault

ONSET = 12
DETECTORS = DetectorsConfig(robust_z=RobustZConfig(warmup=ONSET))


def _run(model, tmp_path, spec: str | None, steps: int):
    return run_fault(model, tmp_path, spec, steps, DETECTORS)


@pytest.mark.slow
@pytest.mark.timeout(900)
class TestFaultsInTheLoop:
    @pytest.mark.parametrize(("spec", "steps"), [
        ("stale-weights@4", 8),  # weights versions and token alignment need no warm baseline
        ("temperature-mismatch=1.1", 4),
        ("off-by-one@4", 8),
        ("bf16-noise=1@12", 20),
        ("corrupt-seqs=0.03@12", 16),
    ])
    def test_fault_is_caught_and_named(self, tiny_model, ray_local, tmp_path, spec, steps):
        """No alarm before the fault acts, one at its first step, and diagnose names its cause and touched requests."""
        fault, result, touched = _run(tiny_model("hybrid"), tmp_path, spec, steps)
        alarms = alarm_steps(result)
        assert alarms and alarms[0] == fault.start  # caught on the first step it acts, not before
        verdict = diagnose(tmp_path).verdict
        assert verdict.cause == fault.cause, verdict.evidence
        assert verdict.affected_steps[0] == fault.start
        truth = set().union(*(touched.get(s, set()) for s in verdict.affected_steps))
        named = set(verdict.affected_request_ids)
        assert named and named <= truth  # every request named was touched by the fault
        if fault.name == "corrupt-seqs":  # a per-request fault: exactly the touched requests of the
            assert named == truth  # steps it names (it halts when the corrupt sequences recur)
        if fault.name == "stale-weights":  # direct evidence: the rollouts' weights lag the trainer's
            assert result.halted and result.steps_run == fault.start + 1
            assert any("behind the trainer's" in line for line in verdict.evidence)


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestEngineFaultsInTheLoop:
    def test_stale_state_appears_once_slots_are_reused(self, tiny_model, ray_local, tmp_path):
        """Stale Mamba state inside the rollout engine: step 0 (fresh slots) is clean, later steps alarm,
        and diagnose names stale state."""
        _, result, _ = _run(tiny_model("hybrid"), tmp_path, "stale-state", 3)
        alarms = alarm_steps(result)
        assert alarms and alarms[0] == 1  # the first wave's slots were never held before
        assert diagnose(tmp_path).verdict.cause == "stale_state"

    def test_index_wrap_is_caught(self, tiny_model, ray_local, tmp_path):
        """State slots aliased past 16 blocks (64 live requests hold 256): the first step halts."""
        _, result, _ = _run(tiny_model("hybrid"), tmp_path, "index-wrap=16", 3)
        assert result.halted and alarm_steps(result) == [0]


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestSyncCheckInTheLoop:
    """Syncs that count as done but leave the engine on other weights: the versions agree, and only
    the sync check (fingerprints after every sync) sees it, at the first step after the first sync;
    rows sent in another order (permute-sync) leave every plain sum as it was and are named by the
    fingerprint's order-weighted part."""

    @pytest.mark.parametrize(("spec", "layers", "group"), [
        ("drop-sync=shared_mlp", [0, 1, 2, 3], "linear"),  # every layer's MLP left out of the sync
        ("permute-sync=self_attn", [2], "linear"),  # the hybrid's one attention layer, its rows rolled
        ("stale-buffer", [0, 1, 3], "buffers"),  # the Mamba layers' conv buffers keep old values
    ])
    def test_halts_at_the_first_spoiled_step_naming_the_layers(self, tiny_model, ray_local, tmp_path, spec, layers, group):
        _, result, touched = _run(tiny_model("hybrid"), tmp_path, spec, 3)
        assert result.halted and result.steps_run == 2 and not touched[0] and touched[1]
        (alarm,) = [a for a in result.reports[-1].alarms if a.kind == "weights"]
        assert alarm.step == 1 and alarm.severity == "critical"
        assert alarm.details["layers"] == layers
        assert alarm.details["differing"] == [f"{i}:{group}" for i in layers]
        assert diagnose(tmp_path).verdict.cause == "weights_out_of_sync"
        metrics = [json.loads(line)["metrics"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        # step 0 checked the engine's own load (clean); step 1 the first sync
        assert metrics[0]["sync/fingerprint_differs"] == 0 and metrics[1]["sync/fingerprint_differs"] == len(layers)

    def test_an_engine_loaded_wrong_halts_before_any_sync(self, tiny_model, ray_local, tmp_path):
        """perturb-layer=1 (layer 1's output projection x1.01 inside vLLM): the check of the engine's
        own load, before step 0, names layer 1 from its fingerprint, and step 0 halts."""
        _, result, _ = _run(tiny_model("hybrid"), tmp_path, "perturb-layer=1", 3)
        assert result.halted and result.steps_run == 1
        (alarm,) = [a for a in result.reports[-1].alarms if a.kind == "weights"]
        assert alarm.step == 0 and alarm.details["layers"] == [1] and alarm.details["differing"] == ["1:linear"]
        assert alarm.message.startswith("the weights the engine loaded") and alarm.details["probe"] is None
