"""The engine self-audits' pure parts, without vLLM: decode vs prefill and batch-invariance verdicts,
the `--audit` names and settings, their JSON, console lines, sweep columns and plot, and the loop's
audit step with a stand-in engine (the real engine runs in tests/integration/test_stress.py and
test_audit_loop.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from rich.console import Console

from rlcheck.engines.vllm import Rollout, VLLMConfig
from rlcheck.errors import ConfigError
from rlcheck.forensics.audits import BatchInvariance, DecodePrefill
from rlcheck.forensics.audits.report import render_audits
from rlcheck.forensics.slots import SlotContext
from rlcheck.forensics.stress import StressConfig, StressResult, serial_config
from rlcheck.forensics.stress.config import parse_audits
from rlcheck.forensics.stress.report import render_sweep, write_sweep
from rlcheck.forensics.sweep import SweepPoint, SweepResult
from rlcheck.loop.audit import AUDIT_FAILING, SIGNATURE, DecodePrefillAudit, audit_step, check_sampling


def _lp(*xs):
    return np.array(xs, dtype=np.float32)


class TestDecodePrefill:
    def test_failing_requests_and_first_divergence(self):
        """A request fails when any token differs past the threshold; the first such token is named."""
        audit = DecodePrefill.of(["a", "b", "c"], [_lp(-1, -2), _lp(-1, -2, -3), _lp(-0.5)],
                                 [_lp(-1, -2), _lp(-1, -2.5, -3), _lp(-0.5 + 1e-6)], threshold=1e-3)
        assert audit.failing_request_ids == ["b"] and audit.first_divergence[1] == 1
        assert audit.max_abs_diff[1] == pytest.approx(0.5) and audit.max_abs_diff[2] < 1e-3
        d = audit.to_dict()
        assert d["failing_request_ids"] == ["b"] and d["max_abs_diff"] == pytest.approx(0.5)
        assert d["threshold"] == 1e-3 and d["num_requests"] == 3 and d["failing"][0]["first_divergence"] == 1

    def test_non_finite_fails(self):
        """A -inf on one side only is a failure (inf difference)."""
        audit = DecodePrefill.of(["a"], [_lp(-1, -np.inf)], [_lp(-1, -2)], threshold=0.5)
        assert audit.failing_request_ids == ["a"] and math.isinf(audit.max_abs_diff[0])


class TestBatchInvariance:
    def test_distinct_outputs_first_difference_and_max_before_it(self):
        """Per request: distinct token outputs over the runs, where they part, max |d| before that."""
        runs = {"base": ([(1, 2, 3), (4, 5)], [_lp(-1, -1, -1), _lp(-2, -2)]),
                "serial": ([(1, 2, 3), (4, 6)], [_lp(-1, -1.2, -1), _lp(-2.1, -9)]),
                "shuffled": ([(1, 2, 3), (4, 7)], [_lp(-1, -1, -1), _lp(-2, -9)])}
        inv = BatchInvariance.of(["a", "b"], runs, threshold=0.05)
        assert inv.distinct == (1, 3) and inv.first_difference == (None, 1)
        assert inv.max_abs_diff[0] == pytest.approx(0.2) and inv.max_abs_diff[1] == pytest.approx(0.1)
        assert inv.differing == [0, 1] and inv.distinct_outputs == 3
        d = inv.to_dict()
        assert d["requests_differing"] == 2 and d["requests_tokens_differing"] == 1
        assert d["requests_by_distinct_outputs"] == {"1": 1, "3": 1} and d["runs"] == ["base", "serial", "shuffled"]

    def test_identical_runs_do_not_differ(self):
        """The same tokens and logprobs in every run: nothing differs, one output each."""
        runs = {name: ([(1, 2)], [_lp(-1, -2)]) for name in ("x", "y", "z")}
        inv = BatchInvariance.of(["a"], runs, threshold=1e-3)
        assert inv.requests_differing == 0 and inv.distinct_outputs == 1 and inv.max_abs_diff == (0.0,)

    def test_needs_two_runs(self):
        """One run compares with nothing: refused."""
        with pytest.raises(ConfigError, match="two runs"):
            BatchInvariance.of(["a"], {"x": ([(1,)], [_lp(-1)])}, threshold=1e-3)


class TestSettings:
    def test_parse_audits(self):
        """Repeatable or comma-separated, put in the canonical order; unknown names refused."""
        assert parse_audits(["batch-invariance", "decode-prefill"]) == ("decode-prefill", "batch-invariance")
        assert parse_audits(["decode-prefill,batch-invariance"]) == ("decode-prefill", "batch-invariance")
        assert parse_audits(None) == ()
        with pytest.raises(ConfigError, match="unknown audit"):
            parse_audits(["prefill"])

    def test_stress_config_checks_audits(self):
        """Unknown audits and a decode-prefill that cannot fit prompt + response + 1 are refused."""
        with pytest.raises(ConfigError, match="unknown audit nope"):
            StressConfig(model="m", audits=("nope",))
        with pytest.raises(ConfigError, match="decode-prefill"):
            StressConfig(model="m", max_prompt_tokens=16, max_tokens=8, max_model_len=24, audits=("decode-prefill",))
        assert StressConfig(model="m", max_prompt_tokens=16, max_tokens=8, max_model_len=24).audits == ()

    def test_serial_run_keeps_only_a_perturbed_layer(self):
        """The serial run drops state faults (they stand for the stress load) but keeps a wrong weight."""
        cfg = StressConfig(model="m", fault="stale-state", guard=True, audits=("batch-invariance",))
        assert serial_config(cfg).fault == "none" and serial_config(cfg).max_num_seqs == 1
        assert not serial_config(cfg).guard and serial_config(cfg).audits == ()
        assert serial_config(StressConfig(model="m", fault="perturb-layer", layer=1)).layer == 1


def _result(judge="reference", failing=("2",), audit_failing=("2",)) -> StressResult:
    n = 4
    ids = tuple(map(str, range(n)))
    dp = DecodePrefill(ids, tuple(5.0 if i in audit_failing else 0.0 for i in ids), (0,) * n, 1e-3)
    bi = BatchInvariance(ids, ("max_num_seqs=8", "max_num_seqs=1", "max_num_seqs=8, shuffled"), (1, 1, 2, 1),
                         (None, None, 3, None), (0.0, 0.0, 0.4, 0.0), 1e-3)
    return StressResult(config=StressConfig(model="m", audits=("decode-prefill", "batch-invariance")), request_ids=ids,
                        max_abs_diff=tuple(5.0 if i in failing else 0.0 for i in ids), first_divergence=(None,) * n,
                        contexts=tuple(SlotContext(i) for i in range(n)), fault_affected={}, num_blocks=8,
                        num_steps=4, trace="slot trace", judge=judge,
                        audits={"decode_prefill": dp, "batch_invariance": bi})


class TestReport:
    def test_json_and_console(self):
        """stress.json's audits entries, the verdict lines (same requests as the reference) and the table."""
        r = _result()
        d = r.to_dict()
        assert d["judge"] == "reference" and d["audits"]["decode_prefill"]["failing_request_ids"] == ["2"]
        assert d["audits"]["batch_invariance"]["requests_differing"] == 1 and r.audit_failed
        console = Console(record=True, width=200)
        render_audits(r, console)
        text = console.export_text()
        assert "decode vs prefill: FAIL" in text and "the same requests as the reference" in text
        assert "batch invariance: FAIL" in text and "1 of 4 requests differ" in text

    def test_disagreement_with_the_reference_is_counted(self):
        """Requests the audit and the reference disagree on are counted on both sides."""
        console = Console(record=True, width=200)
        render_audits(_result(failing=("1",), audit_failing=("2", "3")), console)
        assert "2 only in the audit, 1 only in the reference" in console.export_text()


class TestSweepColumns:
    def test_points_table_and_plot(self, tmp_path):
        """A sweep point carries the audits' counts; the table shows them and the plot gets its second row."""
        point = SweepPoint.of("max_num_seqs", 8, _result())
        assert (point.decode_prefill_failing, point.requests_differing, point.distinct_outputs) == (1, 1, 2)
        result = SweepResult(StressConfig(model="m"), (point, SweepPoint.of("max_num_seqs", 1, _result(failing=()))))
        console = Console(record=True, width=200)
        render_sweep(result, console)
        text = console.export_text()
        assert "dp fail" in text and "differ" in text
        table, png = write_sweep(result, tmp_path)
        assert table.exists() and (png is None or png.stat().st_size > 0)


class _Engine:
    """Stands in for the loop's RolloutSupervisor: `rescore` returns the decode logprobs, one shifted."""

    def __init__(self, shift: dict[int, float]):
        self.shift, self.asked = shift, []

    def call(self, submit):
        return submit(self)

    @property
    def rescore(self):
        engine = self

        class Remote:
            @staticmethod
            def remote(prompts, responses):
                engine.asked.append(len(prompts))
                return [np.full(len(r), -1.0 + engine.shift.get(len(r), 0.0), np.float32) for r in responses]

        return Remote


def _rollouts(lengths):
    return [Rollout(f"e/s0/{i}", str(i), i, 0, (1, 2), tuple(range(n)), np.full(n, -1.0, np.float32), None, "", None,
                    0, 0) for i, n in enumerate(lengths)]


class TestLoopAudit:
    def test_clean_sample_has_no_alarm(self):
        """Prefill equal to decode: no alarm, the scalars count the sample."""
        engine = _Engine({})
        alarms, extra = audit_step(engine, _rollouts([3, 4, 5]), 0, DecodePrefillAudit(sample=2), "float32")
        assert alarms == [] and extra[AUDIT_FAILING] == 0 and engine.asked == [2]

    def test_failing_rollouts_make_one_alarm_naming_them(self):
        """Rollouts off by 0.8 nats fail: one critical signature alarm naming them (the quarantine reads them)."""
        alarms, extra = audit_step(_Engine({4: 0.8}), _rollouts([3, 4, 4]), 5, DecodePrefillAudit(sample=8), "bfloat16")
        (a,) = alarms
        assert a.kind == "signature" and a.severity == "critical" and a.step == 5
        assert a.details["signature"] == SIGNATURE and a.details["request_ids"] == ["e/s0/1", "e/s0/2"]
        assert a.details["threshold"] == 0.5 and extra[AUDIT_FAILING] == 2

    def test_settings_and_sampling_refused(self):
        """Bad settings, and tempered or processed sampling the prefill cannot reproduce, are refused."""
        for kw in ({"sample": 0}, {"threshold": 0}, {"severity": "loud"}):
            with pytest.raises(ConfigError):
                DecodePrefillAudit(**kw)
        check_sampling(VLLMConfig(model="m"))
        check_sampling(VLLMConfig(model="m", greedy=True))
        with pytest.raises(ConfigError, match="temperature 1"):
            check_sampling(VLLMConfig(model="m", temperature=0.7))
