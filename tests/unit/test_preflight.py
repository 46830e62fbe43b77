"""rlcheck.preflight's static part: each check on small configs and the tiny model's tokenizer, the
config's validation, the renderer, and the attach-time policy (a warning block; critical refused)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from rlcheck.errors import ConfigError
from rlcheck.preflight import Finding, PreflightConfig, attach_check, load_side, render, run_static
from rlcheck.preflight.models import check_configs, check_generation_defaults, rope
from rlcheck.preflight.static import check_dtype, check_prefix_cache, check_sampling
from rlcheck.preflight.tokens import bos_count, check_double_bos, check_tokenizer_size, check_tokenizers

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 128,
         "num_hidden_layers": 4, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "dtype": "float32"}


def keys(findings) -> list[str]:
    return [f.key for f in findings]


def edited(config: dict, **fields) -> dict:
    return {**json.loads(json.dumps(config)), **fields}


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def variant(llama, tmp_path):
    """`variant(**config_fields) -> folder`: a copy of the tiny llama's config and tokenizer, config edited."""
    def make(**fields):
        out = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        for f in llama.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, out / f.name)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **fields}))
        return out
    return make


@pytest.fixture(scope="module")
def tokenizer(llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama)


class TestPreflightConfig:
    def test_spellings_are_normalised(self):
        """raw/processed and dtype aliases become vLLM's and torch's names."""
        cfg = PreflightConfig(model="m", logprobs_mode="raw", dtype="bf16", trainer_dtype="torch.float32")
        assert (cfg.logprobs_mode, cfg.dtype, cfg.trainer_dtype) == ("raw_logprobs", "bfloat16", "float32")
        assert PreflightConfig(model="m", dtype="auto").dtype == "auto" and cfg.engine_path == "m"

    @pytest.mark.parametrize("fields, says", [
        ({"logprobs_mode": "logits"}, "logprobs_mode"), ({"dtype": "int8"}, "int8"), ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"), ({"temperature": 0.0}, "temperature"), ({"trainer_dtype": "auto"}, "trainer_dtype"),
        ({"model": ""}, "model"),
    ])
    def test_bad_values_are_config_errors(self, fields, says):
        """Each bad value is a ConfigError naming the setting."""
        with pytest.raises(ConfigError, match=says):
            PreflightConfig(**{"model": "m", **fields})


class TestModelConfigs:
    def test_identical_configs_agree(self):
        """The same config on both sides: no finding."""
        assert check_configs(LLAMA, edited(LLAMA)) == []

    def test_rope_theta_in_either_layout(self):
        """A RoPE base differs whether written as transformers 5's rope_parameters or 4's rope_theta; the
        same base in the two layouts is no finding."""
        old = {k: v for k, v in LLAMA.items() if k != "rope_parameters"} | {"rope_theta": 10000.0}
        assert check_configs(LLAMA, old) == []
        (f,) = check_configs(LLAMA, edited(old, rope_theta=500000.0))
        assert (f.key, f.severity, f.trainer, f.engine) == ("rope_theta", "error", 10000.0, 500000.0)
        assert "rope_parameters" in f.fix

    def test_rope_scaling(self):
        """A yarn scaling on one side is a rope_scaling finding; the "default" rope type is no scaling."""
        yarn = edited(LLAMA, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0})
        assert rope(LLAMA) == (10000.0, None)
        assert keys(check_configs(LLAMA, yarn)) == ["rope_scaling"]

    @pytest.mark.parametrize("field, value, severity", [
        ("sliding_window", 64, "error"), ("tie_word_embeddings", True, "error"), ("vocab_size", 2304, "critical"),
        ("eos_token_id", 7, "warn"), ("num_hidden_layers", 2, "error"),
    ])
    def test_fields_that_change_the_function(self, field, value, severity):
        """Each compared field is found with its severity and both values."""
        (f,) = check_configs(LLAMA, edited(LLAMA, **{field: value}))
        assert (f.key, f.severity, f.engine) == (field, severity, value)
        assert f.trainer == LLAMA.get(field) and f.fix.endswith(".")  # sliding_window: None, no window

    def test_set_on_one_side_only_is_a_warning(self):
        """Where transformers has no config class to normalise with (a remote-code model type), a field
        one config sets and the other leaves unset is at most a warning."""
        custom = edited(LLAMA, model_type="not_in_transformers")
        (f,) = check_configs(custom, {k: v for k, v in custom.items() if k != "tie_word_embeddings"})
        assert (f.key, f.severity, f.engine) == ("tie_word_embeddings", "warn", "(unset)")

    def test_unset_is_the_class_default(self):
        """A field left unset on one side is its config class's default there (transformers fills it
        in for both the trainer and vLLM): unset vs that default is no finding, vs another value one."""
        unset = {k: v for k, v in LLAMA.items() if k not in ("tie_word_embeddings", "rms_norm_eps")}
        assert check_configs(LLAMA, unset) == []
        (f,) = check_configs(unset, edited(unset, rms_norm_eps=1e-5))
        assert (f.key, f.severity, f.trainer, f.engine) == ("rms_norm_eps", "error", 1e-6, 1e-5)

    def test_text_config_is_read(self):
        """A multimodal config's text_config fields count as the model's."""
        nested = {"model_type": "llava", "text_config": {**LLAMA, "rope_parameters": {"rope_theta": 1e6}}}
        assert "rope_theta" in keys(check_configs(edited(nested, text_config=LLAMA), nested))

    def test_generation_defaults(self):
        """A generation_config.json setting top_k is an info finding; neutral values are none."""
        (f,) = check_generation_defaults({"top_k": 50, "temperature": 1.0, "bos_token_id": 0})
        assert (f.key, f.severity, f.engine) == ("generation_defaults", "info", {"top_k": 50})
        assert check_generation_defaults({"top_p": 1.0, "top_k": 0}) == []


class TestTokenizers:
    def test_same_tokenizer_agrees(self, tokenizer):
        """The tiny model's tokenizer against itself: nothing; its template writes BOS once."""
        assert check_tokenizers(tokenizer, tokenizer) == [] and bos_count(tokenizer) == 1
        assert check_double_bos(tokenizer, "trainer") == []

    def test_vocab_special_tokens_and_template(self, llama):
        """A token added, another EOS and another chat template: three findings."""
        from transformers import AutoTokenizer

        a, b = AutoTokenizer.from_pretrained(llama), AutoTokenizer.from_pretrained(llama)
        b.add_tokens(["<|tool|>"])
        b.eos_token = "<|pad|>"
        b.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        found = {f.key: f for f in check_tokenizers(a, b)}
        assert set(found) == {"tokenizer_vocab", "special_tokens", "chat_template"}
        assert found["tokenizer_vocab"].severity == "critical" and "<|tool|>" in found["tokenizer_vocab"].message
        assert found["special_tokens"].engine == {"eos_token": ("<|pad|>", 2)}
        assert check_tokenizer_size(b, {"vocab_size": 2048}, "engine")[0].key == "tokenizer_size"

    def test_double_bos(self, llama):
        """A tokenizer that adds BOS under a template that writes it: BOS twice, a `double_bos` warning."""
        from tokenizers import processors
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(llama)
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", tok.bos_token_id)])
        assert bos_count(tok) == 2
        (f,) = check_double_bos(tok, "engine")
        assert (f.key, f.severity, f.trainer, f.engine) == ("double_bos", "warn", None, "2 x <|bos|>")
        assert "add_special_tokens=False" in f.fix


class TestSampling:
    @pytest.mark.parametrize("fields, want", [
        ({}, []), ({"temperature": 0.7}, []), ({"logprobs_mode": "raw"}, []),
        ({"logprobs_mode": "raw", "temperature": 0.7}, [("logprobs_mode", "error")]),
        ({"logprobs_mode": "processed_logits"}, [("logprobs_mode", "critical")]),
        ({"temperature": 0.7, "trainer_temperature": 1.0}, [("temperature", "error")]),
        ({"top_p": 0.9}, [("top_p", "error")]), ({"top_k": -1}, []),
        ({"top_k": 20, "logprobs_mode": "raw"}, [("top_k", "info")]),
    ])
    def test_what_the_engine_reports_vs_what_the_trainer_scores(self, fields, want):
        """Raw logprobs at T != 1, a temperature the trainer does not score at, and filters with
        processed logprobs make the sides differ; raw logprobs with a filter are a note."""
        found = check_sampling(PreflightConfig(model="m", **fields))
        assert [(f.key, f.severity) for f in found] == want

    @pytest.mark.parametrize("caching, resets, want", [
        (True, None, [("prefix_cache", "info")]), (True, False, [("prefix_cache", "error")]),
        (True, True, []), (False, False, []),
    ])
    def test_prefix_cache_vs_who_resets_it(self, caching, resets, want):
        """Prefix caching with no reset after a sync is an error; not knowing who resets it, a note."""
        cfg = PreflightConfig(model="m", prefix_caching=caching, resets_prefix_cache=resets)
        assert [(f.key, f.severity) for f in check_prefix_cache(cfg)] == want


class TestProbeDevice:
    @pytest.mark.parametrize("device, cuda, want", [
        (None, True, "cuda"), (None, False, "cpu"), ("cpu", True, "cpu"), ("cuda:1", True, "cuda:1"),
    ])
    def test_scores_where_the_trainer_runs(self, device, cuda, want):
        """The probe's HF forward runs on the trainer's device: the GPU by default where there is one
        (before, always the CPU: a 7B in float32 is 28 GB of host memory), the CPU where asked."""
        from rlcheck.preflight.dynamic import probe_device

        assert probe_device(PreflightConfig(model="m", trainer_device=device), cuda=cuda) == want

    def test_a_missing_gpu_and_a_bad_name_are_refused(self):
        """A CUDA device on a machine without one, or a device rlcheck does not know, is a ConfigError."""
        from rlcheck.preflight.dynamic import probe_device

        with pytest.raises(ConfigError, match="no CUDA device"):
            probe_device(PreflightConfig(model="m", trainer_device="cuda:0"), cuda=False)
        with pytest.raises(ConfigError, match="trainer_device"):
            PreflightConfig(model="m", trainer_device="tpu")


class TestDtype:
    @pytest.mark.parametrize("dtype, trainer_dtype, want", [
        (None, None, None), ("auto", None, ("float32", "bfloat16")), ("auto", "bfloat16", None),
        ("float32", "bfloat16", ("bfloat16", "float32")),
    ])
    def test_each_sides_dtype(self, llama, dtype, trainer_dtype, want):
        """Engine dtype: asked, else the config's, "auto" running a float32 checkpoint in bfloat16."""
        side = load_side("trainer", llama, with_tokenizer=False)
        found = check_dtype(PreflightConfig(model="m", dtype=dtype, trainer_dtype=trainer_dtype), side, side)
        assert ([(f.trainer, f.engine.split()[0]) for f in found] or [None])[0] == want


class TestRunStatic:
    def test_one_folder_is_healthy(self, llama):
        """A model against itself: nothing differs (the prefix-cache note only), one result for the CLI."""
        result = run_static(PreflightConfig(model=str(llama)))
        assert not result.differs and result.keys() == ["prefix_cache"]
        assert "nothing found" in render(result)

    def test_two_folders_worst_first(self, llama, variant):
        """Another RoPE base and raw logprobs at T=0.7: errors first, with keys and fixes in the JSON."""
        other = variant(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
        result = run_static(PreflightConfig(model=str(llama), engine_model=str(other),
                                            temperature=0.7, logprobs_mode="raw", resets_prefix_cache=True))
        assert result.differs and result.keys() == ["rope_theta", "logprobs_mode"]
        data = json.loads(json.dumps(result.to_dict()))
        assert data["findings"][0]["engine"] == 5e5 and all(f["fix"] for f in data["findings"])
        assert "2 setting(s) would make the two sides differ (2 error)" in render(result)

    def test_a_folder_without_config(self, tmp_path, llama):
        """What cannot be read is a note, not a crash."""
        result = run_static(PreflightConfig(model=str(llama), engine_model=str(tmp_path), resets_prefix_cache=True))
        assert set(result.keys()) == {"unread"} and not result.differs


class TestAttach:
    def test_findings_are_one_warning_block(self, llama):
        """Findings print once, as a RuntimeWarning naming the key and the fix; they are returned."""
        with pytest.warns(RuntimeWarning, match="(?s)where.*dtype.*fix:") as caught:
            found = attach_check(PreflightConfig(model=str(llama), dtype="auto", resets_prefix_cache=True), where="where")
        assert keys(found) == ["dtype"] and len(caught) == 1

    def test_nothing_found_is_silent(self, llama):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert attach_check(PreflightConfig(model=str(llama), resets_prefix_cache=True), where="x") == ()

    def test_critical_findings_are_refused(self, llama, variant):
        """A vocabulary mismatch leaves nothing to compare: a ConfigError naming the key and its fix."""
        cfg = PreflightConfig(model=str(llama), engine_model=str(variant(vocab_size=4096)), resets_prefix_cache=True)
        with pytest.raises(ConfigError, match="(?s)cannot be compared.*vocab_size.*fix:"):
            attach_check(cfg, where="x")

    def test_finding_validates_its_severity(self):
        with pytest.raises(ValueError, match="severity"):
            Finding("k", "fatal", 1, 2, "m", "f")
