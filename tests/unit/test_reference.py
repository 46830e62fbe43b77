"""Where the HF reference runs and in what dtype (`rlcheck.engines.reference`), and the option's way
through replay, localize, stress, sweep and their CLI flags, with the tolerance that goes with it.
(CPU paths here; no GPU: a CUDA device is refused by name where this process sees none.)"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rlcheck.cli import app
from rlcheck.core.batch import StepBatch
from rlcheck.core.limits import ENGINE_TOL, FP32_ENGINE_TOL, logprob_tolerance
from rlcheck.core.run.dump import write_dump
from rlcheck.engines.reference import ReferenceConfig, load_reference
from rlcheck.errors import ConfigError
from rlcheck.forensics.stress.config import StressConfig


def dump(tmp_path, model, n=3, length=12):
    """A dump of `n` sequences of the tiny model's own tokens, both sides its fp32 logprobs."""
    from rlcheck.engines.hf import HFScorer, HFScorerConfig

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, 5).tolist() for _ in range(n)]
    responses = [rng.integers(3, 200, length).tolist() for _ in range(n)]
    lp = HFScorer(HFScorerConfig(model=str(model))).score(prompts, responses)
    batch = StepBatch.from_ragged(logp_rollout=lp, logp_train=[a.copy() for a in lp], request_ids=[f"r{i}" for i in range(n)],
                                  tokens=[np.array(r) for r in responses], prompt_tokens=[np.array(p) for p in prompts])
    return write_dump(tmp_path / "dump", batch, step=1, context={"model": str(model)})


class TestReferenceConfig:
    def test_names_and_checks(self):
        assert ReferenceConfig("bf16").dtype == "bfloat16" and ReferenceConfig("fp32", "cuda:1").device == "cuda:1"
        for bad in ({"dtype": "int8"}, {"device": "gpu"}, {"device": "cuda:x"}):
            with pytest.raises(ConfigError, match="reference"):
                ReferenceConfig(**bad)

    @pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
    def test_unseen_gpu_refused_before_loading(self, tmp_path):
        """`cuda` in a process without one: a ConfigError naming the device and the CPU alternative."""
        with pytest.raises(ConfigError, match="'cuda'.*--device cpu"):
            load_reference(tmp_path / "nothing-read", ReferenceConfig(device="cuda"))

    def test_tolerance_goes_with_the_coarser_dtype(self):
        assert logprob_tolerance("float32", "float32") == FP32_ENGINE_TOL
        assert logprob_tolerance("float32", "bfloat16") == logprob_tolerance("auto", "float32") == ENGINE_TOL
        assert StressConfig(model="m").fail_threshold == FP32_ENGINE_TOL
        assert StressConfig(model="m", reference_dtype="bfloat16").fail_threshold == ENGINE_TOL


class TestReplay:
    def test_bfloat16_reference_on_cpu(self, tmp_path, tiny_model):
        """A bf16 reference on CPU loads in bf16, says so in the report, and lands within bf16 noise of
        the fp32 engine's logprobs (under the default threshold)."""
        from rlcheck.forensics.replay import replay

        model = tiny_model("llama")
        report = replay(dump(tmp_path, model), reference=ReferenceConfig("bfloat16"))
        assert (report.reference_dtype, report.reference_device) == ("bfloat16", "cpu")
        worst = max(r.score for r in report.records)
        assert 1e-4 < worst < report.threshold  # bf16 rounding shows, and stays inside the tolerance
        assert not report.failed

    def test_cli_flags(self, tmp_path, tiny_model):
        """`rlcheck replay --reference-dtype bfloat16` runs it; `--device cuda` without one: exit 2, named."""
        d = dump(tmp_path, tiny_model("llama"))
        done = CliRunner().invoke(app, ["replay", str(d), "--reference-dtype", "bf16", "--json"])
        assert done.exit_code == 0, done.output
        assert len(json.loads(done.stdout)) == 3
        if not torch.cuda.is_available():
            done = CliRunner().invoke(app, ["replay", str(d), "--device", "cuda"])
            assert done.exit_code == 2 and "CUDA device" in done.output


class TestPlumbing:
    """localize, stress and sweep hand the option to the reference they load."""

    @pytest.fixture
    def loads(self, monkeypatch):
        asked = []

        def load_scorer(model_dir, reference=None):
            asked.append(reference)
            raise RuntimeError("stop here")

        for name in ("rlcheck.forensics.replay", "rlcheck.forensics.localize"):
            monkeypatch.setattr(importlib.import_module(name), "load_scorer", load_scorer)
        return asked

    def test_localize(self, loads, tmp_path, tiny_model):
        import rlcheck.forensics.localize as localize_mod

        with pytest.raises(RuntimeError, match="stop here"):
            localize_mod.localize(dump(tmp_path, tiny_model("llama")), reference=ReferenceConfig("float16"))
        assert loads == [ReferenceConfig("float16")]

    def test_stress_and_sweep(self, loads, tiny_model):
        from rlcheck.forensics.stress import run_stress
        from rlcheck.forensics.sweep import parse_knob, run_sweep

        cfg = StressConfig(model=str(tiny_model("llama")), reference_dtype="bfloat16", reference_device="cpu")
        for run in (lambda: run_stress(cfg), lambda: run_sweep(cfg, [parse_knob("max_num_seqs=2")])):
            with pytest.raises(RuntimeError, match="stop here"):
                run()
        assert loads == [ReferenceConfig("bfloat16")] * 2

    def test_cli_stress_and_localize_flags(self, tmp_path, monkeypatch, tiny_model):
        """`rlcheck stress|sweep|localize --reference-dtype --device` reach the config each builds."""
        localize_mod, stress_mod, sweep_mod = (importlib.import_module(f"rlcheck.forensics.{m}")
                                               for m in ("localize", "stress", "sweep"))

        seen = []
        monkeypatch.setattr(stress_mod, "run_stress", lambda cfg, out, progress=None: seen.append(cfg) or exit(3))
        monkeypatch.setattr(sweep_mod, "run_sweep", lambda cfg, knobs, progress=None: seen.append(cfg) or exit(3))
        monkeypatch.setattr(localize_mod, "localize", lambda *a, **kw: seen.append(kw["reference"]) or exit(3))
        model = str(tiny_model("llama"))
        flags = ["--reference-dtype", "bfloat16", "--device", "cpu"]
        runner = CliRunner()
        runner.invoke(app, ["stress", "--model", model, "--out", str(tmp_path / "s"), *flags])
        runner.invoke(app, ["sweep", "--model", model, "--knob", "max_num_seqs=2", "--out", str(tmp_path / "w"), *flags])
        runner.invoke(app, ["localize", str(dump(tmp_path, model)), "--fault", "none", *flags])
        assert [(c.reference_dtype, c.reference_device) for c in seen[:2]] == [("bfloat16", "cpu")] * 2
        assert seen[2] == ReferenceConfig("bfloat16", "cpu")
