"""Quarantine and the IS correction in the real loop (vLLM, Ray, the hf trainer): the corrupted sequences
leave the step and the loss while the run goes on; a stale recurrent state is too much to mask and
still halts. The loss weighting itself is checked on a real model without the loop."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.faults import parse_inject
from rlcheck.loop import run_grpo
from rlcheck.loop.driver import GRPOLoop
from rlcheck.loop.presets import tiny_cpu
from rlcheck.trainers import Sequences
from rlcheck.trainers.loss import clipped_surrogate


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "loop.jsonl").read_text().splitlines()]


class TestLossWeights:
    def test_a_zero_weight_token_moves_nothing(self):
        """The weighted surrogate: a token of weight 0 adds no loss and no gradient, a weight scales it."""
        logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
        old = logp.detach().clone()
        adv = torch.tensor([1.0, -1.0, 2.0])
        terms = clipped_surrogate(logp, old, adv, 0.2, 0.2, torch.tensor([1.0, 0.0, 0.5]))
        terms.loss_sum.backward()
        assert terms.loss_sum.item() == pytest.approx(-1.0 + 0.0 - 1.0)
        assert logp.grad.tolist() == pytest.approx([-1.0, 0.0, -1.0])

    def test_weights_must_match_the_responses(self):
        seqs = Sequences.build([[1, 2]], [[3, 4, 5]])
        with pytest.raises(Exception, match="loss weights"):
            seqs.with_update_inputs([1.0], [np.zeros(3)], [np.ones(2)], 2)

    def test_loop_weights_come_from_the_report(self, tmp_path):
        """`GRPOLoop._loss_weights`: the quarantined sequence gets weight 0, the loss averages over the
        kept tokens, and loop.jsonl's line says what was dropped; token TIS weights where asked."""
        rng = np.random.default_rng(0)
        lr = [-rng.uniform(0.1, 3, 20) for _ in range(40)]
        lt = [np.minimum(x + rng.normal(0, 0.01, 20), 0) for x in lr]
        lr[3] = np.full(20, -0.001)
        lt[3] = np.full(20, -5.0)
        batch = StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=[f"r{i}" for i in range(40)])
        with Monitor(MonitorConfig(tmp_path, sinks=(), quarantine=QuarantineConfig())) as mon:
            report = mon.observe(0, batch)
        plain = SimpleNamespace(cfg=SimpleNamespace(correction=None))
        weights, tokens, dropped = GRPOLoop._loss_weights(plain, report, batch)
        assert tokens == 39 * 20 and dropped["dropped_tokens"] == 20
        assert dropped["quarantined"] == [{"request_id": "r3", "reason": "catastrophic"}]
        assert not weights[3].any() and all((w == 1).all() for i, w in enumerate(weights) if i != 3)
        tis = SimpleNamespace(cfg=SimpleNamespace(correction=CorrectionConfig(rollout_is="token")))
        weights, _, dropped = GRPOLoop._loss_weights(tis, report, batch)
        want = np.minimum(np.exp(lt[0].astype(np.float64) - lr[0]), 2.0)
        np.testing.assert_allclose(weights[0], want, rtol=1e-5)
        assert not weights[3].any() and 0.99 < dropped["correction"]["rollout_is_eff_sample_size"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
class TestQuarantineInTheLoop:
    def test_corrupted_sequences_are_quarantined_and_the_run_goes_on(self, tiny_model, ray_local, tmp_path):
        """corrupt-seqs=0.1 (6 of 64 sequences a step) with quarantine on and token TIS in the loss: no halt
        over 5 steps, each step's quarantined requests are exactly the ones the fault corrupted, their
        tokens leave the loss, and their sequences are in quarantine/step_N/."""
        model = tiny_model("hybrid")
        cfg = tiny_cpu(model, trainer="hf", steps=5, fault=parse_inject("corrupt-seqs=0.1"))
        cfg = dataclasses.replace(cfg, correction=CorrectionConfig(rollout_is="token"))
        with Monitor(MonitorConfig(tmp_path, sinks=("jsonl",), quarantine=QuarantineConfig(),
                                   context=cfg.context())) as mon:
            result = run_grpo(cfg, mon)
        assert not result.halted and result.steps_run == 5
        for line in _lines(tmp_path):
            quarantined = {q["request_id"] for q in line["quarantined"]}
            assert quarantined == set(line["fault_touched"]), line["step"]
            assert line["dropped_tokens"] > 0 and "rollout_is_eff_sample_size" in line["correction"]
        dumps = sorted(p.name for p in (tmp_path / "quarantine").iterdir())
        assert dumps == [f"step_{s:06d}" for s in range(5)]
        records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        lines = _lines(tmp_path)
        assert all(r["metrics"]["rlcheck/quarantine/count"] == len(x["fault_touched"]) > 0
                   for r, x in zip(records, lines, strict=True))
        assert all(r["metrics"]["rlcheck/seq/catastrophic_count"] == 0 for r in records)  # judged on the kept

    def test_stale_state_is_too_much_to_quarantine(self, tiny_model, ray_local, tmp_path):
        """The engine's stale Mamba state garbles a good part of each step once slots are reused: the
        quarantined fraction passes max_frac and the run halts, judged whole (the dump holds the step)."""
        model = tiny_model("hybrid")
        cfg = tiny_cpu(model, trainer="hf", steps=6, fault=parse_inject("stale-state"))
        with Monitor(MonitorConfig(tmp_path, sinks=("jsonl",), quarantine=QuarantineConfig(),
                                   context=cfg.context())) as mon:
            result = run_grpo(cfg, mon)
        assert result.halted and result.dump_dir
        last = result.reports[-1]
        kinds = {a.kind for a in last.alarms if a.severity == "critical"}
        assert "quarantine" in kinds, last.alarms
        assert last.metrics["rlcheck/quarantine/frac"] > 0.1
