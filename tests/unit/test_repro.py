"""`rlcheck repro` without an engine: the case and its knobs, the shrink on a stand-in prober (ddmin,
bisection, the one-step passes, 1-minimality, the budget), what it reads from a run, a dump and a stress
output, the written repro.py (it imports vllm, torch and transformers only), its verdict lines, the vLLM
plugin (cheap, a no-op without RLCHECK_VLLM_FAULT) and the CLI's refusals."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.run.dump import write_dump
from rlcheck.errors import ConfigError, InputError
from rlcheck.forensics.repro import standalone
from rlcheck.forensics.repro.case import Case, Request
from rlcheck.forensics.repro.config import ReproConfig
from rlcheck.forensics.repro.files import CASE_LINE, script
from rlcheck.forensics.repro.probe import BudgetSpent, Probe
from rlcheck.forensics.repro.shrink import SHRINK_AXES, Shrinker
from rlcheck.forensics.repro.source import read_source, run_fault

ROOT = Path(__file__).resolve().parents[2]


def request(n, prompt_len=8, max_tokens=6, token=5):
    return Request(tuple([token] + list(range(100, 100 + prompt_len - 1))), max_tokens, f"r{n}")


def case(history=0, batch=6, knobs=(("enforce_eager", True), ("max_num_seqs", 64)), update=False, **kw):
    return Case(model="m", history=tuple(request(100 + i) for i in range(history)),
                batch=tuple(request(i, **kw) for i in range(batch)), knobs=knobs, weight_update=update,
                base=(("dtype", "float32"), ("seed", 0), ("max_model_len", 256)))


class FakeProber:
    """Probes a case with a pure predicate: `fails(case) -> set of failing batch indices`; counts and caches."""

    def __init__(self, fails, budget=1000):
        self.fails_of, self.budget, self.used, self.cache, self.calls = fails, budget, 0, {}, []

    def __call__(self, case, phase, charge=True):
        key = case.key()
        if key not in self.cache:
            if self.used >= self.budget:
                raise BudgetSpent(phase)
            self.used += 1
            self.calls.append(phase)
            failing = self.fails_of(case)
            self.cache[key] = Probe(max_abs_diff=tuple(5.0 if i in failing else 0.0 for i in range(len(case.batch))),
                                    first_divergence=tuple(0 if i in failing else None for i in range(len(case.batch))),
                                    threshold=1e-3)
        return self.cache[key]


def stale_state(case):
    """A stale-state-like failure: a batch request fails when a request was served before it (history,
    or an earlier one at max_num_seqs 1) and its prompt holds >= 3 tokens and it generates >= 2."""
    one_at_a_time = case.knob_dict.get("max_num_seqs") == 1
    return {i for i, r in enumerate(case.batch) if len(r.prompt) >= 3 and r.max_tokens >= 2
            and (case.history or (one_at_a_time and i > 0))}


def wrap(case):
    """An index-wrap-like failure: every batch request fails once 3 run at the same time and the
    engine is eager."""
    concurrent = min(len(case.batch), case.knob_dict.get("max_num_seqs") or 256)
    return set(range(len(case.batch))) if concurrent >= 3 and case.knob_dict.get("enforce_eager") else set()


class TestCase:
    def test_knob_changes_and_dtype(self):
        """Knobs are sorted changes from vLLM's defaults; the model's own dtype is no change; unknown knobs are refused."""
        c = case()
        assert [k for k, _ in c.knobs] == ["enforce_eager", "max_num_seqs"]
        assert c.dtype == "float32" and c.threshold == 1e-3  # the dtype is a base setting, never vLLM's "auto"
        assert c.with_knob("dtype", "bfloat16").threshold == 0.5
        assert "max_num_seqs" not in c.without_knob("max_num_seqs").knob_dict
        with pytest.raises(ValueError, match="not knobs"):
            Case(model="m", batch=(request(0),), knobs=(("gpu_memory_utilization", 0.2),))

    def test_standalone_payload_and_key(self):
        """The script's CASE carries the engine, both waves, the update and the threshold; equal runs, equal keys."""
        c = case(history=1, update=True)
        payload = c.standalone()
        assert payload["engine"] == {"dtype": "float32", "seed": 0, "max_model_len": 256, "enforce_eager": True,
                                     "max_num_seqs": 64}
        assert len(payload["history"]) == 1 and len(payload["batch"]) == 6
        assert payload["weight_update"] == {"seed": 0, "scale": 0.01} and payload["threshold"] == 1e-3
        assert c.key() == case(history=1, update=True).key() != case(history=1).key()


class TestShrinker:
    def test_stale_state_shrinks_to_two_requests_one_at_a_time(self):
        """From 6 + 6 requests the shrink finds one earlier request and one batch request, each cut to the
        shortest prompt and max_tokens that still fail, and undoes the unneeded knob changes."""
        prober = FakeProber(stale_state)
        start = case(history=6, batch=6)
        out = Shrinker(prober).run(start, prober(start, "confirm"))
        c = out.case
        assert out.minimal and out.stopped is None
        assert len(c.history) + len(c.batch) == 2 and len(c.batch) >= 1
        assert all(len(r.prompt) >= 1 for r in c.requests)
        assert max(len(r.prompt) for r in c.batch) == 3 and max(r.max_tokens for r in c.batch) == 2
        assert "enforce_eager" not in c.knob_dict  # undone: not needed

    def test_result_is_one_minimal(self):
        """Any one further reduction of the result makes the stand-in failure vanish."""
        for predicate in (stale_state, wrap):
            prober = FakeProber(predicate)
            start = case(history=2, batch=8)
            c = Shrinker(prober).run(start, prober(start, "confirm")).case
            assert predicate(c)
            for r in c.requests:
                fewer = c.with_requests(tuple(x for x in c.history if x != r), tuple(x for x in c.batch if x != r))
                assert not fewer.batch or not predicate(fewer)
                if len(r.prompt) > 1:
                    shorter = replace(r, prompt=r.prompt[:-1])
                    assert not predicate(c.with_requests(tuple(shorter if x == r else x for x in c.history),
                                                         tuple(shorter if x == r else x for x in c.batch)))
            for name in c.knob_dict:
                assert not predicate(c.without_knob(name))

    def test_index_wrap_keeps_the_concurrency_it_needs(self):
        """A failure that needs three requests at once keeps three, and keeps the eager knob it needs."""
        prober = FakeProber(wrap)
        start = case(batch=8)
        c = Shrinker(prober).run(start, prober(start, "confirm")).case
        assert len(c.batch) == 3 and not c.history and c.knob_dict == {"enforce_eager": True}
        assert all(len(r.prompt) == 1 and r.max_tokens == 1 for r in c.batch)

    def test_deterministic(self):
        """The same start gives the same case, steps and probe count."""
        runs = []
        for _ in range(2):
            prober = FakeProber(stale_state)
            start = case(history=4, batch=5)
            out = Shrinker(prober).run(start, prober(start, "confirm"))
            runs.append((out.case.key(), [s.what for s in out.steps], prober.used))
        assert runs[0] == runs[1]

    def test_budget_stops_it_with_a_failing_case(self):
        """A spent budget stops the shrink where it is: the case still fails, and says it is not shown minimal."""
        prober = FakeProber(stale_state, budget=6)
        start = case(history=6, batch=6)
        out = Shrinker(prober).run(start, prober(start, "confirm"))
        assert not out.minimal and out.stopped and stale_state(out.case)
        assert prober.used == 6

    def test_eager_is_undone_last_or_kept(self):
        """vLLM's compiled default (slow on CPU) is tried once every other reduction is done; compiled=False keeps eager."""
        start = case(history=3, batch=3)
        prober = FakeProber(stale_state)
        out = Shrinker(prober).run(start, prober(start, "confirm"))
        assert out.steps[-1].what == "enforce_eager back to vLLM's default" and out.compiled
        assert "enforce_eager" not in out.case.knob_dict
        prober = FakeProber(stale_state)
        kept = Shrinker(prober, compiled=False).run(start, prober(start, "confirm"))
        assert kept.case.knob_dict["enforce_eager"] is True and not kept.compiled and kept.minimal

    def test_axes_not_searched_are_left_alone(self):
        """Without the knob and length axes the shrink removes requests only."""
        prober = FakeProber(stale_state)
        start = case(history=3, batch=3)
        c = Shrinker(prober, axes=("requests",)).run(start, prober(start, "confirm")).case
        assert c.knobs == start.knobs and len(c.requests) == 2
        assert {len(r.prompt) for r in c.requests} == {8} and {r.max_tokens for r in c.requests} == {6}


def _dump(path: Path, *, step=3, version=3, fault="stale-state", context_extra=None, meta=None, train_off=0.0, alarms=()):
    prompts = [[0, 5, 6, 7], [0, 8, 9]]
    responses = [[11, 12, 1], [13, 14]]
    rollout = [np.array([-1.0, -2.0, -0.1]), np.array([-0.5, -0.4])]
    train = [r - np.where(np.arange(r.size) == 0, 2.0, 0.0) - train_off for r in rollout]
    batch = StepBatch.from_ragged(logp_rollout=rollout, logp_train=train, request_ids=["rollout0/s3/0", "rollout0/s3/1"],
                                  tokens=[np.array(r) for r in responses], prompt_tokens=[np.array(p) for p in prompts],
                                  weight_version=[version, version], meta=meta)
    context = {"model": str(path / "model"), "fault": fault, "sampling": {"temperature": 1.0},
               "engine": {"dtype": "float32", "kv_cache_bytes": 64 << 20, "max_num_seqs": None}, **(context_extra or {})}
    (path / "model").mkdir(parents=True, exist_ok=True)
    (path / "model" / "config.json").write_text(json.dumps({"model_type": "granitemoehybrid", "dtype": "float32"}))
    return write_dump(path / "run" / "dumps" / f"step_{step:06d}", batch, step=step, context=context, alarms=alarms)


class TestSource:
    def test_run_dump_becomes_the_recorded_case(self, tmp_path):
        """A run's halted step: its requests greedy with their response lengths, served once before when
        the step is not the first, a weight update when the rollouts carry a version, the fault re-injected."""
        _dump(tmp_path)
        source = read_source(tmp_path / "run")
        c = source.case
        assert source.kind == "run" and source.nothing is None and source.fault == "stale-state"
        assert [r.prompt for r in c.batch] == [(0, 5, 6, 7), (0, 8, 9)] and [r.max_tokens for r in c.batch] == [3, 2]
        assert len(c.history) == 2 and c.weight_update and c.knob_dict == {"enforce_eager": True}
        assert dict(c.base)["kv_cache_memory_bytes"] == 64 << 20 and c.dtype == "float32"
        assert any("weight version 3" in line for line in source.recorded)

    def test_first_step_without_history_or_update(self, tmp_path):
        """Step 0 on the loaded weights: no earlier requests, no weight update; a data fault is not injected."""
        dump = _dump(tmp_path, step=0, version=0, fault="off-by-one")
        source = read_source(dump)
        assert source.kind == "dump" and not source.case.history and not source.case.weight_update
        assert source.fault is None and source.run_dir == tmp_path / "run"

    def test_weight_lag_points_at_the_sync(self, tmp_path):
        """A dump whose halt was the weight-version alarm: repro reads it as the trainer's side of the sync."""
        from rlcheck.core import metrics as K
        from rlcheck.forensics.repro import _version_lag

        alarm = {"kind": "weights", "metric": K.WEIGHTS_MAX_LAG, "step": 3, "severity": "critical",
                 "message": "64 of 64 sequences were generated by weights 1 version(s) behind the trainer's 3", "details": {}}
        source = read_source(_dump(tmp_path, fault="stale-weights@2", alarms=[alarm]))
        assert "behind the trainer's 3" in _version_lag(source.meta)
        assert _version_lag(read_source(_dump(tmp_path / "b")).meta) is None

    def test_run_without_dump_has_nothing(self, tmp_path):
        """A run that never halted: nothing to reproduce, said with what it holds."""
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 0, "metrics": {}, "alarms": []}) + "\n")
        source = read_source(tmp_path / "run")
        assert source.case is None and "has no dump" in source.nothing and "did not halt" in source.nothing

    def test_not_a_directory_is_refused(self, tmp_path):
        with pytest.raises(InputError, match="not a directory"):
            read_source(tmp_path / "nope")

    def test_run_fault_spellings(self):
        """The plugin's spelling of the run's fault; data faults none; a loop-only engine fault a note."""
        assert run_fault("index-wrap=16") == ("index-wrap=16", None)
        assert run_fault("perturb-layer=1") == ("perturb-layer=1", None)
        assert run_fault("stale-buffer") == ("stale-buffer", None)
        assert run_fault("off-by-one@4") == (None, None) and run_fault("none") == (None, None)
        fault, note = run_fault("stale-prefix-cache@2")
        assert fault is None and "runs without it" in note


    def test_stale_buffer_is_a_stress_fault(self):
        """`rlcheck stress --inject stale-buffer`: one weight sync before the generation, kept by the serial audit run."""
        from rlcheck.forensics.stress import StressConfig, parse_inject, serial_config

        assert parse_inject("stale-buffer") == ("stale-buffer", None)
        with pytest.raises(ConfigError, match="stale-buffer"):
            parse_inject("stale-buffers")
        cfg = StressConfig(model="m", fault="stale-buffer")
        assert serial_config(cfg).fault == "stale-buffer" and serial_config(cfg).max_num_seqs == 1


class TestScript:
    def test_standalone_imports_vllm_torch_transformers_only(self):
        """repro.py (the standalone module) imports the standard library, vllm, torch and transformers, never rlcheck."""
        tree = ast.parse(Path(standalone.__file__).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert names - set(sys.stdlib_module_names) - {"__future__"} == {"vllm", "torch", "transformers"}

    def test_script_fills_the_case_and_compiles(self, tmp_path):
        """The written script holds the case as a Python literal and runs its verdict without rlcheck."""
        payload = case(history=1, update=True).standalone(model="model")
        text = script(payload)
        assert CASE_LINE not in text and "CASE: dict[str, Any] = {'model': 'model'" in text
        compile(text, "repro.py", "exec")
        (tmp_path / "repro.py").write_text(text)
        code = ("import sys; sys.path.insert(0, '.'); sys.modules['rlcheck'] = None; import repro; "
                "print(repro.CASE['weight_update'], len(repro.CASE['batch']))")
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
        assert done.stdout.split() == ["{'seed':", "0,", "'scale':", "0.01}", "6"]

    def test_verdict_lines(self, capsys):
        """The first divergent token with both logprobs, and the exit code: 1 when a request is off, 0 when not."""
        c = {"threshold": 1e-3, "batch": [{"prompt_token_ids": [1, 2], "max_tokens": 3}]}
        outputs = [{"token_ids": [7, 8, 9], "logprobs": [-1.0, -2.5, -0.1]}]
        assert standalone.verdict(c, outputs, [[-1.0, -0.5, -0.1]]) == 1
        out = capsys.readouterr().out
        assert "generated position 1: token id 8, vLLM logprob -2.5, Transformers logprob -0.5" in out
        assert "REPRODUCED: 1 of 1" in out
        assert standalone.verdict(c, outputs, [[-1.0, -2.5, -0.1000002]]) == 0
        assert "NOT REPRODUCED" in capsys.readouterr().out
        assert standalone.divergence([float("nan")], [-1.0], 1e-3) == (float("inf"), 0)


class TestPlugin:
    def test_no_op_and_cheap_without_the_variable(self):
        """Without RLCHECK_VLLM_FAULT, register() returns at once and importing the plugin loads neither vLLM nor torch."""
        code = ("import sys, os; os.environ.pop('RLCHECK_VLLM_FAULT', None); import rlcheck.engines.vllm_plugin as p; "
                "p.register(); print('vllm' in sys.modules, 'torch' in sys.modules)")
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        assert done.stdout.split() == ["False", "False"]

    def test_spellings(self):
        from rlcheck.engines.vllm_plugin import parse, spelling

        assert parse("index-wrap=8") == ("index-wrap", {"boundary": 8})
        assert spelling(*parse("perturb-layer=2")) == "perturb-layer=2"
        assert parse("stale-buffer") == ("stale-buffer", {})
        with pytest.raises(ConfigError, match="the vLLM plugin injects"):
            parse("off-by-one")
        with pytest.raises(ConfigError, match="moe-route-flip"):
            parse("moe-route-flip=0.5")

    def test_entry_point_declared(self):
        """pyproject.toml registers the plugin in vLLM's general plugin group."""
        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        assert project["entry-points"]["vllm.general_plugins"] == {"rlcheck_faults": "rlcheck.engines.vllm_plugin:register"}


class TestProbe:
    def test_error_line_names_the_problem(self):
        """pydantic's header line is skipped: the assertion vLLM failed is what the knob table shows."""
        from rlcheck.forensics.repro.probe import error_line

        exc = ValueError("1 validation error for VllmConfig\n  Assertion failed, Chunked prefill is required for "
                         "mamba cache mode 'align'. [type=assertion_error, input_value=...]")
        assert error_line(exc) == "Chunked prefill is required for mamba cache mode 'align'."
        assert error_line(RuntimeError("boom")) == "boom"


class TestConfig:
    def test_refusals(self):
        with pytest.raises(ConfigError, match="unknown shrink axes"):
            ReproConfig(axes=("requests", "tokens"))
        with pytest.raises(ConfigError, match="confirmations"):
            ReproConfig(confirmations=0)
        assert ReproConfig().axes == SHRINK_AXES


class TestReport:
    def test_report_and_json_of_a_reproduced_case(self, tmp_path):
        """REPORT.md has the bug template's sections and the knob table, layer, audits and reduction;
        repro.json holds the same, as JSON."""
        from rlcheck.forensics.audits import BatchInvariance, DecodePrefill
        from rlcheck.forensics.localize.compare import localize_request
        from rlcheck.forensics.repro.config import REPRODUCED, ReproResult
        from rlcheck.forensics.repro.files import to_dict
        from rlcheck.forensics.repro.report import render_report
        from rlcheck.forensics.repro.shape import Row
        from rlcheck.forensics.repro.shrink import Shrunk, Step
        from rlcheck.forensics.repro.source import Source

        start = replace(case(history=4, batch=4, update=True), fault="stale-state")
        small = replace(start, history=start.history[:1], batch=start.batch[:1], knobs=(), weight_update=False)
        probe = Probe(max_abs_diff=(2.5,), first_divergence=(0,), tokens=((7, 8),), logprobs=(np.array([-3.0, -1.0]),),
                      reference=(np.array([-0.5, -1.0]),), threshold=1e-3, info={"num_blocks": 64})
        shrunk = Shrunk(small, probe, (Step("requests", "requests 8 -> 2", small.describe(), 5),), True, None,
                        SHRINK_AXES, compiled=False)
        rel = np.zeros((4, 9))
        rel[0, 8:] = 1.0
        loc = localize_request("batch request 0", rel, ("mamba", "mamba", "attention", "mamba"), 8, 3e-5)
        source = Source("run", tmp_path, dump=tmp_path, case=start, fault="stale-state", recorded=("step 3 of the run",))
        result = ReproResult(REPRODUCED, "reproduced", tmp_path, source, 2, 2, probe, shrunk,
                             table=(Row("the case", "vLLM's defaults", "appears", probe.describe(), own=True),
                                    Row("injected fault", "RLCHECK_VLLM_FAULT unset", "vanishes", "all 1 within 0.001")),
                             localized=[loc], audits={
                                 "decode_prefill": DecodePrefill.of(["batch request 0"], [np.array([-0.5, -1.0])],
                                                                    [np.array([-3.0, -1.0])], threshold=1e-3),
                                 "batch_invariance": BatchInvariance.of(["batch request 0"], {
                                     "the case": ([(7, 8)], [np.array([-3.0, -1.0])]),
                                     "max_num_seqs=1": ([(7, 8)], [np.array([-3.0, -1.0])])}, threshold=1e-3)},
                             script={"with the fault": {"command": "RLCHECK_VLLM_FAULT=stale-state python repro.py",
                                                        "exit_code": 1, "output": "REPRODUCED: 1 of 1\n"}},
                             probes=7, budget=40, seconds={"total": 12.0})
        expected = {"requests": [{"index": 0, "prompt_len": 8, "expected": {"token_ids": [9, 8], "logprobs": [-0.2, -1.0]},
                                  "observed": {"token_ids": [7, 8], "logprobs": [-3.0, -1.0], "reference_logprobs": [-0.5, -1.0],
                                               "max_abs_diff": 2.5, "first_divergence": 0}}]}
        text = render_report(result, expected)
        for needed in ("# [Bug]: ", "## Your current environment", "## 🐛 Describe the bug", "### Minimal program",
                       "### Expected vs observed", "| injected fault | RLCHECK_VLLM_FAULT unset | **vanishes** |",
                       "first divergent layer **0** (mamba), from generated position 0 on (decode)",
                       "decode vs prefill", "batch invariance", "| requests (earlier + batch) | 4 + 4 | 1 + 1 |",
                       "This failure was injected on purpose", "REPRODUCED: 1 of 1", "vLLM's compiled default was not tried",
                       "token id 7, vLLM logprob -3, Transformers logprob -0.5"):
            assert needed in text, needed
        out = json.loads(json.dumps(to_dict(result), default=str))
        assert out["verdict"] == REPRODUCED and out["minimal"]["minimal"] and out["localized"][0]["first_divergent_layer"] == 0
        assert out["audits"]["decode_prefill"]["num_failing"] == 1
