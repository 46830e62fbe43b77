"""`rlcheck preflight` (static part, --no-probe): exit code 0 when nothing is found, 1 when a setting
would make the sides differ, 2 on bad input; --json lists each finding with its key."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from rlcheck.cli import app


def run(*args):
    return CliRunner().invoke(app, ["preflight", *[str(a) for a in args]])


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """(a, b): the tiny llama, and a copy of its config and tokenizer with another RoPE base."""
    a = tiny_model("llama")
    b = tmp_path_factory.mktemp("preflight") / "b"
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((b / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 500000.0
    (b / "config.json").write_text(json.dumps(cfg))
    return a, b


class TestPreflightCommand:
    def test_healthy_exits_0(self, models):
        """One model on both sides: exit 0, the verdict says nothing differs, the probe was not run."""
        result = run("--model", models[0], "--no-probe")
        assert result.exit_code == 0, result.output
        assert "nothing found that would make the two sides differ" in result.stdout
        assert "probe: not run (--no-probe)" in result.stdout

    def test_findings_exit_1_with_json_keys(self, models):
        """Another RoPE base, raw logprobs at T=0.7, top-p 0.9 and a bf16 engine: exit 1, each a JSON
        finding with its key, severity, both values and the fix."""
        a, b = models
        result = run("--model", a, "--engine-model", b, "--temperature", 0.7, "--top-p", 0.9, "--logprobs-mode", "raw",
                     "--dtype", "bfloat16", "--keeps-prefix-cache", "--no-probe", "--json")
        assert result.exit_code == 1, result.output
        data = json.loads(result.stdout)
        found = {f["key"]: f for f in data["findings"]}
        assert set(found) == {"rope_theta", "logprobs_mode", "prefix_cache", "dtype", "top_p"}
        assert (found["rope_theta"]["trainer"], found["rope_theta"]["engine"]) == (10000.0, 500000.0)
        assert found["top_p"]["severity"] == "info" and data["differs"] is True and data["probe"] is None
        assert all(set(f) == {"key", "severity", "trainer", "engine", "message", "fix"} for f in data["findings"])

    def test_text_output_names_the_fix(self, models):
        """The text output: one paragraph per finding with its fix, and the verdict."""
        result = run("--model", models[0], "--engine-model", models[1], "--resets-prefix-cache", "--no-probe")
        assert result.exit_code == 1
        assert "ERROR    rope_theta: trainer 10000.0 | engine 500000.0" in result.stdout
        assert "fix: Load the engine with the trainer's RoPE settings" in result.stdout
        assert result.stdout.rstrip().endswith("1 setting(s) would make the two sides differ (1 error)")

    def test_hf_overrides_are_the_engines(self, models):
        """--hf-overrides: vLLM's hf_overrides of the engine, compared as the engine runs them: the other
        RoPE base on one model is a rope_theta error (exit 1); the folder's own is nothing (exit 0)."""
        rope = json.loads((models[0] / "config.json").read_text())["rope_parameters"]
        other = json.dumps({"rope_parameters": {**rope, "rope_theta": 4 * rope["rope_theta"]}})
        result = run("--model", models[0], "--no-probe", "--json", "--hf-overrides", other)
        assert result.exit_code == 1, result.output
        found = json.loads(result.stdout)["findings"]
        assert [(f["key"], f["engine"]) for f in found if f["severity"] != "info"] == [("rope_theta", 4 * rope["rope_theta"])]
        same = run("--model", models[0], "--no-probe", "--hf-overrides", json.dumps({"rope_parameters": rope}))
        assert same.exit_code == 0, same.output

    @pytest.mark.parametrize("args, says", [
        (("--model", "/nonexistent/model"), "does not exist"),
        (("--logprobs-mode", "logits"), "logprobs_mode must be raw, processed"),
        (("--dtype", "int4"), "int4"),
        (("--top-p", "1.5"), "top_p"),
        (("--trainer-device", "gpu"), "trainer_device must be cpu, cuda or cuda:N"),
        (("--hf-overrides", "{rope"), "--hf-overrides"),
        (("--hf-overrides", "[1]"), "JSON object"),
    ])
    def test_bad_input_exits_2(self, models, args, says):
        """A missing folder or a bad setting: one `rlcheck: error:` line, exit 2."""
        model = [] if "--model" in args else ["--model", models[0]]
        result = run(*model, *args, "--no-probe")
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("rlcheck: error:") and says in result.stderr

    @pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
    def test_probe_on_a_missing_gpu_is_refused_before_vllm_starts(self, models):
        """--trainer-device cuda on a CPU machine: exit 2 naming the setting, before any engine starts."""
        result = run("--model", models[0], "--trainer-device", "cuda", "--probe")
        assert result.exit_code == 2, result.output
        assert "trainer_device='cuda'" in result.stderr and "no CUDA device" in result.stderr
