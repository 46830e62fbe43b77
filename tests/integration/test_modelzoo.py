"""The tiny model zoo: each architecture builds deterministically, loads in Hugging Face and in vLLM
(CPU backend), and vLLM's sampled-token logprobs match an HF prefill of the same tokens."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rlcheck.errors import ConfigError, InputError
from rlcheck.modelzoo import ARCHS, ModelSpec, build_model, describe, vllm_cpu_kwargs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RLCHECK = str(Path(sys.executable).with_name("rlcheck"))
TEXTS = ["What is 12+7? The answer is 19.", "Q: 305*4\nA: 1220", "The model reads 3 books, then stops!"]
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "hybrid": "GraniteMoeHybridForCausalLM",
    "moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
LOGPROB_ATOL = 2e-5  # measured max |d| in float32 over 1280 sampled tokens: 4.8e-6 .. 1.05e-5
PROMPTS = [
    "What is 12+7?",
    "Q: 3*4\nA:",
    "The policy",
    # longer than the Mamba2 chunk (64 tokens): prefill crosses chunk boundaries
    " ".join(f"{i}+{i + 1}={2 * i + 1}." for i in range(12)),
]


def make_model(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RLCHECK, "make-model", *args], capture_output=True, text=True, timeout=300)


def hf_logprobs(model, prompt_ids: list[int], completion_ids: list[int]):
    """log_softmax of a teacher-forced HF prefill, gathered at the completion tokens: (T,)."""
    ids = torch.tensor([prompt_ids + completion_ids])  # (1, P+T)
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)  # (P+T, V)
    steps = logp[len(prompt_ids) - 1 : -1]  # (T, V): position t predicts token t+1
    return steps.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


@pytest.mark.slow
class TestBuildModel:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_writes_a_model_folder(self, tiny_model, arch):
        """The folder has config, weights, tokenizer and a manifest with a tiny parameter count."""
        path = tiny_model(arch)
        for name in FILES:
            assert (path / name).is_file(), name
        info = describe(path)
        assert info["arch"] == arch and info["vocab_size"] == 2048
        assert 500_000 < info["num_params"] < 3_000_000
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == [HF_ARCHITECTURES[arch]]

    def test_hybrid_mixes_mamba_and_attention(self, tiny_model):
        """The hybrid has both Mamba2 ("linear_attention") and attention layers."""
        layer_types = json.loads((tiny_model("hybrid") / "config.json").read_text())["layer_types"]
        assert set(layer_types) == {"linear_attention", "full_attention"}

    def test_moe_routes_each_token_to_two_of_eight_experts(self, tiny_model):
        """The moe has 2 layers of 8 experts, top-2, and its router spreads tokens over the experts
        (a random router that sent every token to the same pair would make routing agreement trivial)."""
        path = tiny_model("moe")
        config = json.loads((path / "config.json").read_text())
        assert (config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]) == (2, 8, 2)
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ids = transformers.AutoTokenizer.from_pretrained(path)(" ".join(TEXTS), return_tensors="pt").input_ids
        with torch.no_grad():
            router_logits = model(ids, output_router_logits=True).router_logits  # layers x (T, E)
        assert len(router_logits) == 2
        used = {int(e) for logits in router_logits for e in logits.topk(2, dim=-1).indices.flatten()}
        assert len(used) >= 6

    def test_rebuild_is_byte_identical(self, tiny_model, tmp_path):
        """Building the same spec again gives the same bytes in every file; another seed does not."""
        first = tiny_model("hybrid")
        again = build_model("hybrid", tmp_path / "again")
        for path in first.iterdir():
            assert (again / path.name).read_bytes() == path.read_bytes(), path.name
        other = build_model("hybrid", tmp_path / "other", seed=1)
        assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
        assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()

    def test_bfloat16_weights(self, tmp_path):
        """dtype="bfloat16" saves bfloat16 weights that HF loads as bfloat16."""
        path = build_model("llama", tmp_path / "bf16", dtype="bfloat16")
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}

    def test_refuses_a_non_empty_folder_unless_forced(self, tmp_path):
        """An existing non-empty OUT is an InputError; force=True replaces it."""
        (tmp_path / "keep.txt").write_text("x")
        with pytest.raises(InputError, match="not empty"):
            build_model("llama", tmp_path)
        build_model("llama", tmp_path, force=True)
        assert not (tmp_path / "keep.txt").exists() and (tmp_path / "model.safetensors").is_file()

    @pytest.mark.parametrize(
        "bad",
        [
            {"arch": "jamba"},
            {"dtype": "float16"},
            {"vocab_size": 100},
            {"num_layers": 1},
            {"logit_std": -1.0},
        ],
    )
    def test_bad_spec_is_a_config_error(self, bad):
        """An unknown arch or dtype, or a size out of range, raises ConfigError naming the field."""
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ModelSpec(**bad)


@pytest.mark.slow
class TestHFLoad:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_forward_shape_and_entropy(self, tiny_model, arch):
        """HF loads the model; logits are (B, T, V) and the next-token entropy is well below log V."""
        path = tiny_model(arch)
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = tok(" ".join(TEXTS), return_tensors="pt").input_ids  # (1, T)
        with torch.no_grad():
            logp = model(ids).logits.log_softmax(-1)  # (1, T, V)
        assert logp.shape == (1, ids.shape[1], 2048)
        entropy = -(logp.exp() * logp).sum(-1).mean().item()
        assert 1.0 < entropy < math.log(2048) - 2.0


@pytest.mark.slow
class TestTokenizer:
    def test_round_trip(self, tiny_model):
        """ASCII text, whitespace and arithmetic decode back to the same string; digits are single tokens."""
        tok = transformers.AutoTokenizer.from_pretrained(tiny_model("llama"))
        for text in [*TEXTS, "  two  spaces\tand\ttabs\n~{}[]<>|\\^`", "123456789+987654321=1111111110"]:
            ids = tok.encode(text)
            assert tok.decode(ids) == text
        assert tok.convert_ids_to_tokens(tok.encode("2025")) == ["2", "0", "2", "5"]

    def test_special_tokens_and_chat_template(self, tiny_model):
        """BOS/EOS/PAD are ids 0/1/2 and the chat template renders a prompt for the assistant."""
        tok = transformers.AutoTokenizer.from_pretrained(tiny_model("llama"))
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
        text = tok.apply_chat_template(
            [{"role": "user", "content": "12+7="}], add_generation_prompt=True, tokenize=False
        )
        assert text == "<|bos|><|user|>\n12+7=<|eos|>\n<|assistant|>\n"


@pytest.mark.slow
class TestVLLMAgreement:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_sampled_logprobs_match_hf(self, tiny_model, arch, monkeypatch):
        """vLLM CPU samples 16 tokens per prompt; their logprobs match HF's teacher-forced ones to 2e-5."""
        vllm = pytest.importorskip("vllm")
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        path = tiny_model(arch)
        llm = vllm.LLM(model=str(path), **vllm_cpu_kwargs(max_model_len=256))
        params = vllm.SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, seed=1, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        del llm
        gc.collect()
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        for out in outputs:
            done = out.outputs[0]
            assert len(done.token_ids) == 16
            got = torch.tensor([lp[t].logprob for lp, t in zip(done.logprobs, done.token_ids, strict=True)])
            want = hf_logprobs(model, list(out.prompt_token_ids), list(done.token_ids))
            torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0.0)


@pytest.mark.slow
class TestMakeModelCLI:
    def test_builds_and_reports(self, tmp_path):
        """`rlcheck make-model` builds the model and prints arch, parameter count, vocab and path."""
        out = make_model("--arch", "mamba2", "--seed", "3", str(tmp_path / "m"))
        assert out.returncode == 0, out.stderr
        assert (
            "built mamba2:" in out.stdout and "vocab 2048" in out.stdout and str(tmp_path / "m") in out.stdout
        )
        assert describe(tmp_path / "m")["seed"] == 3

    def test_builds_the_moe(self, tmp_path):
        """`--arch moe` builds the Qwen3-MoE (2 layers, 8 experts, top-2)."""
        out = make_model("--arch", "moe", str(tmp_path / "moe"))
        assert out.returncode == 0, out.stderr
        assert "built moe:" in out.stdout and describe(tmp_path / "moe")["num_layers"] == 2

    def test_errors_are_one_line(self, tmp_path):
        """A bad arch and an existing folder without --force exit 2 with a one-line message."""
        bad = make_model("--arch", "jamba", str(tmp_path / "j"))
        assert bad.returncode == 2 and "unknown arch 'jamba'" in bad.stderr and "Traceback" not in bad.stderr
        (tmp_path / "x").write_text("x")
        taken = make_model("--arch", "llama", str(tmp_path))
        assert taken.returncode == 2 and "--force" in taken.stderr


TRAIN_STEPS = 120  # enough to beat the random model clearly (the default 400 takes minutes)


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory):
    """A llama trained for TRAIN_STEPS steps on the addition task (module-wide: ~1-2 CPU minutes)."""
    from rlcheck.modelzoo import build_trained

    return build_trained("llama", tmp_path_factory.mktemp("trained") / "llama", steps=TRAIN_STEPS)


@pytest.mark.slow
class TestBuildTrained:
    def test_answers_better_than_the_random_model(self, trained_llama, tiny_model):
        """Greedy answers of the trained model earn a far higher task reward than the random model's,
        and the manifest records the training and its evaluation."""
        from rlcheck.modelzoo.train import evaluate

        def score(path):
            model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            return evaluate(model, transformers.AutoTokenizer.from_pretrained(path), num_prompts=64)

        trained_acc, trained_reward = score(trained_llama)
        _, random_reward = score(tiny_model("llama"))
        assert trained_reward > random_reward + 0.15, (trained_reward, random_reward)
        info = describe(trained_llama)
        assert info["training"]["steps"] == TRAIN_STEPS and info["max_positions"] == 2048
        assert info["training"]["eval_reward"] > random_reward

    def test_distributions_are_peaked(self, trained_llama, tiny_model):
        """After a prompt "a+b=" the trained model puts almost all its mass on the 10 digit tokens (of
        2048), the random model almost none: it knows what kind of token comes next."""
        def digit_mass(path):
            model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            tok = transformers.AutoTokenizer.from_pretrained(path)
            digits = tok.convert_tokens_to_ids(list("0123456789"))
            ids = torch.tensor([[tok.bos_token_id] + tok.encode(f"{a}+{b}=", add_special_tokens=False)
                                for a, b in ((12, 7), (4, 38), (90, 1))])  # (3, 6)
            with torch.no_grad():
                p = model(ids).logits[:, -1].softmax(-1)  # (3, V)
            return float(p[:, digits].sum(-1).min())

        assert digit_mass(trained_llama) > 0.9
        assert digit_mass(tiny_model("llama")) < 0.2

    def test_rebuild_is_byte_identical(self, tmp_path):
        """The same spec trains to the same bytes; another seed does not."""
        from rlcheck.modelzoo import build_trained

        first = build_trained("llama", tmp_path / "a", steps=4)
        again = build_trained("llama", tmp_path / "b", steps=4)
        for path in first.iterdir():
            assert (again / path.name).read_bytes() == path.read_bytes(), path.name
        other = build_trained("llama", tmp_path / "c", steps=4, seed=1)
        assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()

    def test_ensure_trained_reuses_the_folder(self, trained_llama):
        """`ensure_trained` on a folder that holds a model returns it untouched (the on-disk cache)."""
        from rlcheck.modelzoo import ensure_trained

        before = (trained_llama / "model.safetensors").stat().st_mtime_ns
        assert ensure_trained(trained_llama, "llama", steps=1) == trained_llama
        assert (trained_llama / "model.safetensors").stat().st_mtime_ns == before

    @pytest.mark.parametrize("bad", [{"steps": 0}, {"lr": 0.0}, {"text_share": 1.0}, {"arch": "jamba"},
                                     {"max_positions": 10}])
    def test_bad_spec_is_a_config_error(self, bad):
        """A bad training spec raises ConfigError before anything is built."""
        from rlcheck.modelzoo import TrainSpec

        with pytest.raises(ConfigError):
            TrainSpec(**bad)

    def test_trained_moe_answers_better_than_the_random_moe(self, tiny_model, tmp_path):
        """The MoE trains on the task too: a short run already earns a clearly higher task reward."""
        from rlcheck.modelzoo import build_trained
        from rlcheck.modelzoo.train import evaluate

        def reward(path):
            model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            return evaluate(model, transformers.AutoTokenizer.from_pretrained(path), num_prompts=64)[1]

        trained = build_trained("moe", tmp_path / "moe-trained", steps=TRAIN_STEPS)
        assert describe(trained)["arch"] == "moe" and describe(trained)["num_layers"] == 2
        assert reward(trained) > reward(tiny_model("moe")) + 0.15

    def test_ensure_model_picks_by_folder_name(self, trained_llama, tmp_path):
        """A folder not named `<arch>-trained` gets the random hybrid; an existing model is reused."""
        from rlcheck.modelzoo import ensure_model

        info = describe(ensure_model(tmp_path / "hybrid"))
        assert info["arch"] == "hybrid" and "training" not in info
        assert ensure_model(trained_llama) == trained_llama
