"""A fault's run through the real loop for the integration tests (tests/integration/test_faults_loop.py,
test_faults_inputs_loop.py): the hf trainer on `tiny_cpu`, a JSONL Monitor with the test's detectors."""

from __future__ import annotations

import json

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.faults import parse_inject
from rlcheck.loop import run_grpo
from rlcheck.loop.presets import tiny_cpu


def run_fault(model, tmp_path, spec: str | None, steps: int, detectors):
    """(fault, LoopResult, {step: the request ids the fault touched}) of `steps` loop steps with `spec`."""
    fault = parse_inject(spec)
    cfg = tiny_cpu(model, trainer="hf", steps=steps, fault=fault)
    with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",), context=cfg.context(), detectors=detectors)) as mon:
        result = run_grpo(cfg, mon)
    touched = {}
    for line in (tmp_path / "loop.jsonl").read_text().splitlines():
        rec = json.loads(line)
        touched[rec["step"]] = set(rec.get("fault_touched") or ())
    if fault.name != "none":  # a fault that touched nothing proves nothing: refused, not passed
        assert any(touched.values()), f"{spec} touched no sequence in {steps} steps: it never fired"
    return fault, result, touched


def alarm_steps(result) -> list[int]:
    """The steps of a run that raised any alarm, in order."""
    return sorted({a.step for r in result.reports for a in r.alarms})
