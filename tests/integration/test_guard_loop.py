"""The engine guard inside the real loop (vLLM rollout actor, Ray, HF trainer): a clean guarded run has
no violation; an engine fault is named by the guard at the step it happens, as a halting alarm whose
evidence (invariant, request ids) reaches the dump and diagnose; index-wrap, which diagnose cannot
attribute from logprobs alone in the loop, is named index aliasing."""

from __future__ import annotations

import json

import pytest

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.engines.guard import GUARD_METRIC
from rlcheck.faults import parse_inject
from rlcheck.forensics.diagnose import diagnose
from rlcheck.loop import run_grpo
from rlcheck.loop.presets import tiny_cpu


def _run(model, run_dir, spec: str | None, steps: int):
    cfg = tiny_cpu(model, trainer="hf", steps=steps, fault=parse_inject(spec), guard=True)
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context=cfg.context())) as mon:
        return run_grpo(cfg, mon)


def _guard_alarms(result):
    return [a for r in result.reports for a in r.alarms if a.details.get("signature") == "engine_guard"]


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestGuardInTheLoop:
    def test_clean_guarded_run_has_no_violation(self, tiny_model, ray_local, tmp_path):
        """Three clean guarded steps: zero violations logged every step, no alarm, the guard's files written."""
        result = _run(tiny_model("hybrid"), tmp_path, None, 3)
        assert not result.halted and result.steps_run == 3
        assert [r.metrics[GUARD_METRIC] for r in result.reports] == [0.0, 0.0, 0.0]
        assert not [a for r in result.reports for a in r.alarms]
        assert (tmp_path / "guard" / "trace.jsonl").exists()

    def test_stale_state_is_named_by_the_guard(self, tiny_model, ray_local, tmp_path):
        """Stale state: step 0 clean, step 1 halts on the guard's alarm naming invariants (i)/(v) and
        the requests, with the guard's record in the dump; diagnose reads it (stale_state)."""
        result = _run(tiny_model("hybrid"), tmp_path, "stale-state", 3)
        assert result.halted and result.steps_run == 2
        alarms = _guard_alarms(result)
        assert {a.step for a in alarms} == {1}
        assert {a.details["check"] for a in alarms} <= {"prefill_from_zero", "freed_reinit"}
        ids = {i for a in alarms for i in a.details["request_ids"]}
        assert ids and all(i.startswith("rollout0/s1/") for i in ids)
        assert (tmp_path / "dumps" / "step_000001" / "guard").is_dir()
        verdict = diagnose(tmp_path).verdict
        assert verdict.cause == "stale_state" and "guard" in " ".join(verdict.evidence)

    def test_index_wrap_is_index_aliasing(self, tiny_model, ray_local, tmp_path):
        """Aliased slots (boundary 16, 64 live requests): the guard's slot_unique alarm halts step 0 and
        diagnose names index aliasing."""
        result = _run(tiny_model("hybrid"), tmp_path, "index-wrap=16", 2)
        assert result.halted and {a.step for a in _guard_alarms(result)} == {0}
        assert {a.details["check"] for a in _guard_alarms(result)} == {"slot_unique"}
        assert diagnose(tmp_path).verdict.cause == "index_aliasing"
        lines = [json.loads(x) for x in (tmp_path / "guard" / "violations.jsonl").read_text().splitlines()]
        assert lines and {x["check"] for x in lines} == {"slot_unique"}
