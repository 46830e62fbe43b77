"""The GPU path's device check (`benchmarks/gpu_check.py`) at tiny sizes on CPU, so that the script a lent
GPU runs once cannot rot: every check passes, or is skipped for want of CUDA (Triton's dot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_run_passes_every_check(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(results) == {"env", "triton_dot", "token_logprobs", "stats", "fingerprint", "hf_device", "fsdp2", "sync_group",
                            "gloo"}
    assert {r["status"] for r in results.values()} <= {"PASS", "SKIP"}
    fsdp2 = results["fsdp2"]
    assert fsdp2["fingerprint differs"] == [] and fsdp2["synced weights equal the bf16 model"] and fsdp2["tied weight gathered once"]
    assert results["sync_group"]["backend"] == "gloo" and results["sync_group"]["buckets"] >= 2
    assert results["stats"]["worst relative difference"] < 1e-4
    assert done.stdout.strip().splitlines()[-1].startswith("PASS all: 9 checks")
