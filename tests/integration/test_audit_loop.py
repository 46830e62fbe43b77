"""The decode-prefill audit inside the real loop (vLLM rollout actor, Ray, HF trainer): stale Mamba
state is found from the engine alone, at the step it first happens, as a halting alarm naming the
re-scored rollouts that differ from their fresh prefill (a clean audited run: tests/integration/test_loop.py).
The same run has the top-k distribution metrics on: its first, clean step puts their KL estimate at
the float32 floor (the top-p fault's run: tests/integration/test_topk_loop.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.stats import StatsConfig
from rlcheck.faults import parse_inject
from rlcheck.loop import run_grpo
from rlcheck.loop.audit import AUDIT_FAILING, SIGNATURE, DecodePrefillAudit
from rlcheck.loop.presets import tiny_cpu
from rlcheck.loop.topk_wiring import DEFAULT_TOP_K


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestAuditInTheLoop:
    def test_stale_state_halts_on_the_audit(self, tiny_model, ray_local, tmp_path):
        """Stale state: step 0 (fresh slots) audits clean, its top-k KL at the floor; step 1 halts on the
        audit's alarm, naming step 1's rollouts whose decode differs from their prefill."""
        cfg = replace(tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=3, fault=parse_inject("stale-state")),
                      audit=DecodePrefillAudit(sample=8))
        cfg = replace(cfg, rollout=replace(cfg.rollout, top_logprobs=DEFAULT_TOP_K))
        mcfg = MonitorConfig(run_dir=tmp_path, sinks=("jsonl",), stats=StatsConfig(distribution=True),
                             context=cfg.context())
        with Monitor(mcfg) as mon:
            result = run_grpo(cfg, mon)
        assert result.halted and result.steps_run == 2
        first, halt = result.reports
        assert first.metrics[AUDIT_FAILING] == 0 and not first.alarms
        m = first.metrics  # clean: every token's top-20 scored, KL at the float32 floor (~2e-12), same sets
        assert m[K.DIST_COUNT] == m[K.TOKEN_COUNT] > 0 and m[K.DIST_KL_MEAN] < 1e-8 and m[K.DIST_KL_MAX] < 1e-6
        assert m[K.DIST_TOPK_OVERLAP_MEAN] > 0.999 and m[K.DIST_TOP1_AGREE_FRAC] == 1.0
        (alarm,) = [a for a in halt.alarms if a.details.get("signature") == SIGNATURE]
        assert alarm.severity == "critical" and alarm.step == 1 and halt.metrics[AUDIT_FAILING] >= 1
        ids = alarm.details["request_ids"]
        assert ids and all(i.startswith("rollout0/s1/") for i in ids)
        assert json.loads((tmp_path / "loop.jsonl").read_text().splitlines()[-1])["halted"]
