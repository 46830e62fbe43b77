"""The static preflight at attach time: the TRL adapter (before GRPOTrainer starts vLLM, and on an
existing trainer), the verl adapter (verl's trainer config) and rlcheck's own loop (`LoopConfig`): each
maps its settings onto the two sides, warns with one block, refuses critical findings, and records the
findings in the Monitor's context."""

from __future__ import annotations

import json
import shutil
import warnings
from types import SimpleNamespace

import pytest

from rlcheck.errors import ConfigError


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def copy_with(llama, tmp_path):
    """`copy_with(**config_fields) -> folder`: the tiny llama (weights too) with its config edited."""
    def make(**fields):
        out = tmp_path / "copy"
        shutil.copytree(llama, out)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **fields}))
        return out
    return make


class TestTRL:
    @pytest.fixture
    def grpo(self, tmp_path):
        trl = pytest.importorskip("trl")
        return lambda **kw: trl.GRPOConfig(**{"output_dir": str(tmp_path), "use_cpu": True, "report_to": [],
                                              "use_vllm": True, "bf16": False, **kw})

    def test_model_in_memory_vs_its_folder(self, llama, grpo):
        """A model whose RoPE base was changed in code: vLLM loads the folder's, so rope_theta is an
        error; vLLM's "auto" on the float32 checkpoint against an fp32 trainer is the dtype warning."""
        from transformers import AutoModelForCausalLM

        from rlcheck.integrations.trl.preflight_checks import trl_preflight

        model = AutoModelForCausalLM.from_pretrained(llama)
        model.config.rope_parameters["rope_theta"] = 20000.0
        with pytest.warns(RuntimeWarning, match=r"(?s)rlcheck preflight \(TRL, before vLLM starts\).*rope_theta"):
            found = trl_preflight(grpo(), model)
        assert [(f.key, f.trainer, f.engine) for f in found][0] == ("rope_theta", 20000.0, 10000.0)
        assert [f.key for f in found] == ["rope_theta", "dtype"]

    def test_before_grpo_trainer_starts(self, llama, grpo, monkeypatch):
        """RLCheckGRPOTrainer runs the preflight (bf16 on both sides here: nothing found) before
        GRPOTrainer.__init__, and keeps its findings for the Monitor's context."""
        import trl

        from rlcheck.integrations.trl import RLCheckGRPOTrainer
        from rlcheck.integrations.trl.config import trl_context

        seen = {}

        def started(self, *args, **kwargs):
            seen["preflight"] = self.rlcheck_preflight
            raise RuntimeError("stop here")

        monkeypatch.setattr(trl.GRPOTrainer, "__init__", started)
        with warnings.catch_warnings(), pytest.raises(RuntimeError, match="stop here"):
            warnings.simplefilter("error", RuntimeWarning)
            RLCheckGRPOTrainer(model=str(llama), reward_funcs=len, args=grpo(bf16=True))
        assert seen["preflight"] == ()
        trainer = SimpleNamespace(args=grpo(), model=SimpleNamespace(config=SimpleNamespace()), temperature=1.0,
                                  top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, vllm_generation=None,
                                  vllm_importance_sampling_correction=False, rlcheck_preflight=seen["preflight"])
        assert trl_context(trainer)["preflight"] == []

    def test_attach_monitor_reads_the_running_engines_dtype(self, llama, grpo):
        """On a built trainer the preflight takes the dtype vLLM runs in (float32 here: nothing found),
        records its findings on the trainer, and is not run twice."""
        from transformers import AutoModelForCausalLM

        from rlcheck.integrations.trl.config import TRLOptions
        from rlcheck.integrations.trl.preflight_checks import check_attach

        llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype="torch.float32")))
        trainer = SimpleNamespace(args=grpo(), model=AutoModelForCausalLM.from_pretrained(llama),
                                  vllm_generation=SimpleNamespace(llm=llm))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            check_attach(trainer, TRLOptions())
        assert trainer.rlcheck_preflight == ()
        llm.llm_engine.model_config.dtype = "torch.bfloat16"
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            check_attach(trainer, TRLOptions())  # already run: no second preflight, no warning
        del trainer.rlcheck_preflight
        with pytest.warns(RuntimeWarning, match=r"(?s)TRL, attach_monitor.*dtype: trainer float32 \| engine bfloat16"):
            check_attach(trainer, TRLOptions())

    def test_no_local_folder_is_skipped(self, grpo):
        """A hub id (or a stand-in without a model) has nothing to read: no findings, no warning."""
        from rlcheck.integrations.trl.preflight_checks import trl_preflight

        assert trl_preflight(grpo(), "Qwen/Qwen3-0.6B") == ()


class TestVerl:
    def config(self, path, **rollout):
        omegaconf = pytest.importorskip("omegaconf")
        return omegaconf.OmegaConf.create({"actor_rollout_ref": {
            "model": {"path": str(path), "override_config": rollout.pop("override_config", {})},
            "rollout": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "dtype": "bfloat16",
                        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True, **rollout},
            "actor": {"fsdp_config": {"dtype": "bfloat16"}}}})

    def test_verls_defaults_are_clean(self, llama):
        """verl's defaults (bf16 both sides, processed logprobs, the prefix cache reset by verl): nothing."""
        from rlcheck.integrations.verl import preflight

        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert preflight(self.config(llama)) == ()

    def test_override_config_is_the_trainers_alone(self, llama):
        """model.override_config changes the actor's config, not vLLM's: an rms_norm_eps error; raw
        logprobs at T=0.6 too. An override the config class does not read is none: verl sets
        `rope_theta` on a transformers 5 config whose model reads `rope_parameters`."""
        from rlcheck.integrations.verl import preflight

        cfg = self.config(llama, override_config={"rms_norm_eps": 1e-3}, temperature=0.6, logprobs_mode="raw_logprobs")
        with pytest.warns(RuntimeWarning, match=r"rlcheck preflight \(verl"):
            found = preflight(cfg)
        assert [(f.key, f.trainer) for f in found] == [("rms_norm_eps", 1e-3), ("logprobs_mode", "T=0.6")]
        assert preflight(self.config(llama, override_config={"rope_theta": 1e6})) == ()

    def test_engine_hf_overrides_are_the_engines(self, llama):
        """`rollout.engine_kwargs.vllm.hf_overrides` reaches vLLM (verl spreads engine_kwargs.vllm over its
        arguments): a RoPE base there is the engine's alone, an error; as vLLM's command line's JSON text too.
        Failed before: verl's preflight read the engine's folder only and found nothing."""
        from rlcheck.integrations.verl import preflight

        rope = json.loads((llama / "config.json").read_text())["rope_parameters"]
        theta = {"rope_parameters": {**rope, "rope_theta": 4 * rope["rope_theta"]}}
        for overrides in (theta, json.dumps(theta)):
            with pytest.warns(RuntimeWarning, match="rope_theta"):
                found = preflight(self.config(llama, engine_kwargs={"vllm": {"hf_overrides": overrides}}))
            assert [(f.key, f.trainer, f.engine) for f in found] == [
                ("rope_theta", rope["rope_theta"], 4 * rope["rope_theta"])]
        assert preflight(self.config(llama, engine_kwargs={"vllm": {"hf_overrides": {"rope_parameters": rope}}})) == ()

    def test_logits_mode_is_refused(self, llama):
        """A *_logits mode leaves nothing to compare: ConfigError before verl starts."""
        from rlcheck.integrations.verl import preflight

        with pytest.raises(ConfigError, match="logprobs_mode"):
            preflight(self.config(llama, logprobs_mode="raw_logits"))


    def test_plugin_runs_it_before_init_workers(self, llama):
        """rlcheck's verl plugin wraps the method that starts verl's workers: the preflight first (a
        refusal stops verl before it starts anything), its findings kept in the Monitor's context."""
        from rlcheck.integrations.verl import plugin

        class Trainer:
            config = self.config(llama, temperature=0.5, logprobs_mode="raw_logprobs", calculate_log_probs=True)
            config.rlcheck = {"run_dir": "unused"}
            started = False

            def init_workers(self):
                self.started = True

        trainer = Trainer()
        with pytest.warns(RuntimeWarning, match="logprobs_mode"):
            plugin._wrap_start(Trainer.init_workers)(trainer)
        assert trainer.started and [f["key"] for f in trainer._rlcheck.context["preflight"]] == ["logprobs_mode"]
        Trainer.config = self.config(llama, logprobs_mode="processed_logits", calculate_log_probs=True)
        Trainer.config.rlcheck = {"run_dir": "unused"}
        with pytest.raises(ConfigError, match="logprobs_mode"):
            plugin._wrap_start(Trainer.init_workers)(Trainer())


class TestLoop:
    def loop_config(self, model, **rollout):
        from rlcheck.engines.vllm import VLLMConfig
        from rlcheck.loop.config import LoopConfig
        from rlcheck.trainers import TrainerConfig

        return LoopConfig(rollout=VLLMConfig(model=str(model), **rollout),
                          trainer=TrainerConfig(model=str(model), temperature=rollout.get("temperature", 1.0)))

    def test_mapping(self, llama):
        """The engine side is VLLMConfig's (dtype, mode, sampling; the loop resets the prefix cache), the
        trainer side TrainerConfig's."""
        from rlcheck.loop.preflight_wiring import loop_preflight_config

        cfg = loop_preflight_config(self.loop_config(llama, dtype="bfloat16", allow_logit_processing=True,
                                                     sampling={"top_p": 0.95, "top_k": None}))
        assert (cfg.dtype, cfg.trainer_dtype, cfg.top_p, cfg.top_k, cfg.resets_prefix_cache) == (
            "bfloat16", "float32", 0.95, 0, True)

    def test_check_and_context(self, llama):
        """check_loop warns with the block; the run's context records the same findings."""
        from rlcheck.loop.preflight_wiring import check_loop

        cfg = self.loop_config(llama, dtype="bfloat16")
        with pytest.warns(RuntimeWarning, match=r"(?s)rlcheck's loop.*dtype: trainer float32 \| engine bfloat16"):
            assert [f.key for f in check_loop(cfg)] == ["dtype"]
        assert [f["key"] for f in cfg.context()["preflight"]] == ["dtype"]
        assert self.loop_config(llama).context()["preflight"] == []

    def test_the_engine_as_it_runs(self, llama):
        """vLLM's hf_overrides in `VLLMConfig.engine_kwargs` are the engine's config, and an injected fault's
        settings are what the actors run (`Fault.rollout_config`, `trainer_config`): rope-mismatch=4 is a
        rope_theta error, raw-logprobs a logprobs_mode error, in the warning and in the run's context.
        Failed before: the loop's preflight read the engine's folder and the unfaulted configs (nothing)."""
        from dataclasses import replace

        from rlcheck.faults import parse_inject
        from rlcheck.loop.preflight_wiring import check_loop

        rope = json.loads((llama / "config.json").read_text())["rope_parameters"]
        own = self.loop_config(llama, engine_kwargs={"hf_overrides": {"rope_parameters": {**rope, "rope_theta": 1e6}}})
        with pytest.warns(RuntimeWarning, match="rope_theta"):
            assert [(f.key, f.engine) for f in check_loop(own)] == [("rope_theta", 1e6)]
        faulted = replace(self.loop_config(llama), fault=parse_inject("rope-mismatch=4"))
        (finding,) = faulted.context()["preflight"]
        assert (finding["key"], finding["severity"], finding["engine"]) == ("rope_theta", "error", 4 * rope["rope_theta"])
        raw = replace(self.loop_config(llama, temperature=0.7), fault=parse_inject("raw-logprobs"))
        assert [f["key"] for f in raw.context()["preflight"]] == ["logprobs_mode"]

    def test_an_eager_engine_on_a_gpu_is_said(self, llama):
        """An engine on a GPU with VLLMConfig's default enforce_eager=True: an info finding (no CUDA
        graphs, the fix named); enforce_eager=False, or a CPU engine: nothing."""
        from dataclasses import replace

        from rlcheck.loop import Placement

        gpu = replace(self.loop_config(llama), placement=Placement(rollout_gpus=1.0))
        (finding,) = gpu.context()["preflight"]
        assert (finding["key"], finding["severity"]) == ("enforce_eager", "info")
        assert "CUDA graphs" in finding["message"] and "enforce_eager=False" in finding["fix"]
        assert replace(gpu, rollout=replace(gpu.rollout, enforce_eager=False)).context()["preflight"] == []
        assert self.loop_config(llama).context()["preflight"] == []


def test_the_probe_engine_runs_the_overrides(monkeypatch, llama):
    """The probe's vLLM engine is built with the engine's hf_overrides (vLLM's `engine_kwargs`), so the probe
    scores the engine as it runs (a RoPE base x 4 there: mean |d| 0.0087 on the tiny Llama, past fp32's 1e-3)."""
    import rlcheck.engines.vllm as vllm_engine
    from rlcheck.preflight import PreflightConfig, dynamic

    built = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda cfg: built.append(cfg) or cfg)
    overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": 40000.0}}
    dynamic.open_engine(PreflightConfig(model=str(llama), engine_overrides=overrides), "float32")
    dynamic.open_engine(PreflightConfig(model=str(llama)), "float32")
    assert [cfg.engine_kwargs for cfg in built] == [{"hf_overrides": overrides}, {}]
