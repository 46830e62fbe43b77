"""The faults of issue 28 and their hooks: what the trainer scores instead of the engine's ids
(retokenize, double-bos, left-pad-positions, stop-token), how the engine is set up (stale-prefix-cache,
rope-mismatch, raw-logprobs), and the engine side of stale-prefix-cache (`rlcheck.engines.vllm_prefix`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from rlcheck.engines.vllm import VLLMConfig
from rlcheck.engines.vllm_prefix import keep_prefix_cache
from rlcheck.errors import ConfigError
from rlcheck.faults import (
    FAULTS,
    DoubleBos,
    LeftPadPositions,
    RawLogprobs,
    Retokenize,
    RopeMismatch,
    StalePrefixCache,
    StopToken,
    parse_inject,
)
from rlcheck.faults.engine_settings import PREFIX_TOKENS

BOS, EOS, PAD = 0, 1, 2


class Tokenizer:
    """Stands in for the model's tokenizer: one id per character ("a" = 10, ...) except "ab", one merged token (99)."""

    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out, i = [*out, 99], i + 2
            else:
                out, i = [*out, 10 + ord(text[i]) - ord("a")], i + 1
        return out


@dataclass(frozen=True)
class Trainer:
    temperature: float = 1.0


PROMPTS = [[BOS, 5, 6, 7], [BOS, 5], [BOS, 8, 9]]
RESPONSES = [[10, 11, EOS], [12, 13, 14], [EOS]]
TEXTS = ["ab", "cde", ""]


class TestParse:
    @pytest.mark.parametrize("spec", ["retokenize", "double-bos@3", "left-pad-positions@12", "stop-token",
                                      "stale-prefix-cache", "stale-prefix-cache@8", "rope-mismatch=1.25",
                                      "rope-mismatch=0.5", "raw-logprobs"])
    def test_round_trips(self, spec):
        """Each new fault parses to its class and `describe()` gives the spec back."""
        fault = parse_inject(spec, seed=3)
        assert type(fault) is FAULTS[spec.partition("@")[0].partition("=")[0]][0]
        assert fault.describe() == spec and parse_inject(fault.describe(), seed=3) == fault

    @pytest.mark.parametrize("spec, match", [
        ("rope-mismatch=1", "other than 1"), ("rope-mismatch=0", "factor > 0"), ("rope-mismatch", "a number"),
        ("rope-mismatch=2@3", "first step"), ("raw-logprobs=0.7", "takes no value"), ("raw-logprobs@2", "first step"),
        ("retokenize=1", "takes no value"), ("stop-token=x", "takes no value"),
    ])
    def test_rejects_bad_specs(self, spec, match):
        with pytest.raises(ConfigError, match=match):
            parse_inject(spec)

    def test_causes(self):
        """Each names the cause of the issue's table."""
        causes = {name: FAULTS[name][0].cause for name in ("retokenize", "double-bos", "left-pad-positions", "stop-token",
                                                           "stale-prefix-cache", "rope-mismatch", "raw-logprobs")}
        assert causes == {"retokenize": "retokenization", "double-bos": "prompt_mismatch", "left-pad-positions": "position_ids",
                          "stop-token": "stop_token", "stale-prefix-cache": "stale_prefix_cache",
                          "rope-mismatch": "position_dependent", "raw-logprobs": "logit_processing"}


class TestTrainerInputs:
    def call(self, fault, step=0):
        return fault.trainer_inputs(step, [list(p) for p in PROMPTS], [list(r) for r in RESPONSES], TEXTS, Tokenizer())

    def test_retokenize_scores_the_text_again(self):
        """The text is re-encoded ("ab" is one token where the engine sampled two), the stop token kept; an
        empty text keeps the engine's ids; the prompts are the engine's."""
        got = self.call(Retokenize())
        assert got.responses == [[99, EOS], [12, 13, 14], [EOS]] and got.prompts == PROMPTS and got.left_pad is None

    def test_double_bos(self):
        got = self.call(DoubleBos())
        assert got.prompts == [[BOS, *p] for p in PROMPTS] and got.responses == RESPONSES

    def test_left_pad_to_the_longest_prompt(self):
        """Pad counts: the step's longest prompt minus each; the ids themselves unchanged."""
        got = self.call(LeftPadPositions())
        assert got.left_pad == [0, 2, 1] and got.prompts == PROMPTS and got.responses == RESPONSES

    def test_stop_token_dropped(self):
        """A trailing stop token is dropped; a response of the stop token alone is kept (a response is never empty)."""
        assert self.call(StopToken()).responses == [[10, 11], [12, 13, 14], [EOS]]

    def test_nothing_before_start(self):
        assert self.call(DoubleBos(start=5), step=4) is None and self.call(DoubleBos(start=5), step=5) is not None

    @pytest.mark.parametrize("fault", [Retokenize(), StopToken()])
    def test_lengths_changing_faults_refuse_top_k(self, fault):
        with pytest.raises(ConfigError, match="top_logprobs"):
            fault.rollout_config(VLLMConfig(model="m", top_logprobs=5))
        assert fault.rollout_config(VLLMConfig(model="m")).top_logprobs == 0

    def test_tokenizer_without_bos_is_refused(self):
        class NoBos(Tokenizer):
            bos_token_id = None

        with pytest.raises(ConfigError, match="bos"):
            DoubleBos().trainer_inputs(0, PROMPTS, RESPONSES, TEXTS, NoBos())


class TestEngineSettings:
    def test_stale_prefix_cache_prompts_share_a_long_prefix(self):
        """Prompts 0, 2, ... get the same PREFIX_TOKENS after BOS; the others stay; the engine fault keeps
        the cache from the sync to version max(start, 1)."""
        prompts = [[BOS, 5, 6], [BOS, 7], [BOS, 8, 9, 4]]
        out = StalePrefixCache().prompts(0, prompts, Tokenizer())
        assert out[1] == prompts[1] and len(out[0]) == PREFIX_TOKENS + 3 and out[0][0] == BOS
        assert out[0][1:PREFIX_TOKENS + 1] == out[2][1:PREFIX_TOKENS + 1] and out[2][-3:] == [8, 9, 4]
        assert StalePrefixCache().engine_fault() == ("stale-prefix-cache", {"start": 1})
        assert StalePrefixCache(start=8).engine_fault() == ("stale-prefix-cache", {"start": 8})

    def test_stale_prefix_cache_needs_prefix_caching(self):
        with pytest.raises(ConfigError, match="prefix caching"):
            StalePrefixCache().rollout_config(VLLMConfig(model="m", engine_kwargs={"enable_prefix_caching": False}))

    def test_rope_mismatch_overrides_the_engines_base(self, tmp_path):
        """The engine's hf_overrides carry rope_theta x F (other RoPE keys kept); the trainer is untouched."""
        (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}))
        cfg = RopeMismatch(factor=1.25).rollout_config(VLLMConfig(model=str(tmp_path), engine_kwargs={"hf_overrides": {"x": 1}}))
        assert cfg.engine_kwargs["hf_overrides"] == {"x": 1, "rope_parameters": {"rope_theta": 12500.0, "rope_type": "default"}}
        assert RopeMismatch().trainer_config(Trainer()) == Trainer()

    def test_rope_mismatch_needs_rope(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
        with pytest.raises(ConfigError, match="RoPE"):
            RopeMismatch().rollout_config(VLLMConfig(model=str(tmp_path)))

    @pytest.mark.parametrize("fault", [StalePrefixCache(), RopeMismatch()])
    def test_long_prompt_faults_refuse_a_hybrid(self, fault, tmp_path):
        """Their 320-token prompts fail vLLM 0.32's CPU prefill of a Mamba hybrid: refused, naming an attention-only model."""
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "granitemoehybrid",
                                                          "rope_parameters": {"rope_theta": 10000.0}}))
        with pytest.raises(ConfigError, match="attention-only"):
            fault.rollout_config(VLLMConfig(model=str(tmp_path)))

    def test_rope_mismatch_prompts_have_long_contexts_of_their_own(self):
        """Every other prompt gets PREFIX_TOKENS of context, no two of them the same prefix."""
        out = RopeMismatch().prompts(0, [[BOS, 5]] * 4, Tokenizer())
        assert [len(p) for p in out] == [PREFIX_TOKENS + 2, 2, PREFIX_TOKENS + 2, 2] and out[0][:8] != out[2][:8]

    def test_raw_logprobs_both_sides_at_the_temperature(self):
        """The engine returns raw logprobs and samples at T = 0.7; the trainer scores at 0.7 (a run's own T != 1 kept)."""
        cfg = RawLogprobs().rollout_config(VLLMConfig(model="m"))
        assert (cfg.logprobs_mode, cfg.temperature) == ("raw_logprobs", 0.7)
        assert RawLogprobs().trainer_config(Trainer()).temperature == 0.7
        assert RawLogprobs().trainer_config(Trainer(temperature=0.5)).temperature == 0.5
        with pytest.raises(ConfigError, match="greedy"):
            RawLogprobs().rollout_config(VLLMConfig(model="m", greedy=True))


    def test_engine_setting_faults_say_what_they_touched(self):
        """rope-mismatch and raw-logprobs touch every sequence (the engine computes each with its setting);
        stale-prefix-cache, from its start, the sequences whose prompt holds the shared prefix; the data as it is."""
        import numpy as np

        from rlcheck.core.batch import StepBatch

        prompts = [[BOS] + [3] * PREFIX_TOKENS + [5], [BOS, 5], [BOS] + [3] * PREFIX_TOKENS + [6]]
        batch = StepBatch.from_ragged(logp_rollout=[np.zeros(2)] * 3, logp_train=[np.zeros(2)] * 3,
                                      request_ids=["a", "b", "c"], prompt_tokens=prompts)
        assert RopeMismatch().apply(0, batch) == (batch, ["a", "b", "c"]) == RawLogprobs().apply(5, batch)
        assert StalePrefixCache(start=4).apply(3, batch) == (batch, [])
        assert StalePrefixCache(start=4).apply(4, batch) == (batch, ["a", "c"])


@dataclass
class LLM:
    resets: int = 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


@dataclass
class Engine:
    """Stands in for a `VLLMEngine`: its sync resets the prefix cache, as `load_buckets` does."""

    llm: LLM = field(default_factory=LLM)
    versions: list[int] = field(default_factory=list)

    def sync_weights(self, named_tensors, version: int) -> None:
        self.versions.append(version)
        self.llm.reset_prefix_cache()


class TestKeptPrefixCache:
    def test_syncs_from_start_keep_the_cache(self):
        """Syncs to versions below `start` reset the cache, later ones load the weights and do not; remove() undoes it."""
        engine = Engine()
        handle = keep_prefix_cache(engine, start=3)
        for version in (1, 2, 3, 4):
            engine.sync_weights([], version)
        assert engine.versions == [1, 2, 3, 4] and engine.llm.resets == 2 and handle.kept == 2
        assert "reset_prefix_cache" not in vars(engine.llm)  # the method is back after each sync
        handle.remove()
        engine.sync_weights([], 5)
        assert engine.llm.resets == 3


class TestTrlRefusal:
    @pytest.mark.parametrize("spec", ["double-bos", "retokenize", "left-pad-positions", "stop-token", "stale-prefix-cache",
                                      "raw-logprobs"])
    def test_loop_only_faults_are_refused_with_trl(self, spec):
        """The TRL adapter has no place for the trainer's inputs, the prompts or the engine's sync: it refuses them."""
        from rlcheck.integrations.trl.config import check_fault

        with pytest.raises(ConfigError, match="with TRL"):
            check_fault(spec)
