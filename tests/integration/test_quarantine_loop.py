"""Quarantine and the IS correction in the real loop (vLLM, Ray, the hf trainer): the corrupted sequences
leave the step and the loss while the run goes on; a stale recurrent state is too much to mask and
still halts. The loss weighting itself is checked on a real model without the loop."""

from __future__ import annotations

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
    """(The loop with corrupt-seqs, quarantine and token TIS: `test_cli.py::test_demo_quarantines_instead_of_halting`.)"""

    def test_stale_state_is_too_much_to_quarantine(self, tiny_model, ray_local, tmp_path):
        """The engine's stale Mamba state garbles a good part of each step once slots are reused: the
        quarantined fraction passes max_frac through a burst of early divergences, and the step's samples of
        one prompt are scored apart in identical contexts (split_twins, critical): the halt at step 1, the
        first step that reuses slots, as without quarantine (the dump holds the step)."""
        model = tiny_model("hybrid")
        cfg = tiny_cpu(model, trainer="hf", steps=3, fault=parse_inject("stale-state"))
        with Monitor(MonitorConfig(tmp_path, sinks=("jsonl",), quarantine=QuarantineConfig(),
                                   context=cfg.context())) as mon:
            result = run_grpo(cfg, mon)
        assert result.halted and result.dump_dir and result.steps_run == 2
        last = result.reports[-1]
        critical = {a.details.get("signature", a.kind) for a in last.alarms if a.severity == "critical"}
        assert "split_twins" in critical, last.alarms
        assert last.metrics["rlcheck/quarantine/frac"] > 0.1
