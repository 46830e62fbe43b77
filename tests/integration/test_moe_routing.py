"""MoE routing on both sides, for real: the tiny Qwen3-MoE in an in-process float32 vLLM engine (CPU)
with `RouteCapture` on its routers, and the HF trainer side (`RouteRecorder`) on the same tokens.
One engine for the module; a healthy pass, then the `moe-route-flip` fault."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.moe import Routing, routing_stats

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
vllm = pytest.importorskip("vllm")

PROMPTS = ["What is 12+7?", "Q: 3*4\nA:", "The policy", "12+30=42. 7+5=12. 40+41="]
NUM_TOKENS = 12
LOGPROB_ATOL = 2e-5


def hf_side(model, prompt_ids: list[int], completion: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logprobs (T,), experts (T, L, k)) of one teacher-forced HF forward, routing recorded in it."""
    from rlcheck.engines.moe_routing import response_rows
    from rlcheck.trainers.moe_routing import RouteRecorder

    ids = torch.tensor([prompt_ids + completion])  # (1, P+T)
    with RouteRecorder(model) as routes, torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)  # (P+T, V)
    steps = logp[len(prompt_ids) - 1 : -1]
    lp = steps.gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()
    experts = response_rows(routes.experts(), np.arange(ids.shape[1]), len(prompt_ids), len(completion))
    return lp, experts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny MoE's engine run healthy, then under moe-route-flip=0.5 (gap < 0.02): per run, each request's
    (engine logprobs, engine experts, HF logprobs, HF experts)."""
    from rlcheck.engines.moe_capture import RouteCapture
    from rlcheck.modelzoo import build_model, vllm_cpu_kwargs

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = build_model("moe", tmp_path_factory.mktemp("moe") / "m")
    llm = vllm.LLM(model=str(path), **vllm_cpu_kwargs(max_model_len=256))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    params = vllm.SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, logprobs=0, seed=3, ignore_eos=True)
    from rlcheck.engines.fingerprint import fingerprint_llm
    from rlcheck.trainers.fingerprint import module_fingerprint

    out = {"fingerprints": (fingerprint_llm(llm), module_fingerprint(model, torch.float32))}
    try:
        for name, flip in (("healthy", 0.0), ("flip", 0.5)):
            with RouteCapture(llm, flip=flip, near_tie=0.02) as capture:
                out[f"fingerprint {name}"] = fingerprint_llm(llm)
                rows = []
                for o in llm.generate(PROMPTS, params, use_tqdm=False):
                    done, prompt = o.outputs[0], list(o.prompt_token_ids)
                    lp = np.array([d[t].logprob for d, t in zip(done.logprobs, done.token_ids, strict=True)])
                    experts = capture.response_experts(o.request_id, len(prompt), len(done.token_ids))
                    rows.append((lp, experts, *hf_side(model, prompt, list(done.token_ids))))
            out[name] = rows
        from rlcheck.engines.vllm_sync import has_prepacked_moe

        out["prepacked"] = llm.apply_model(has_prepacked_moe)  # what TRL's adapter asks before its first sync
        out["reload"] = reload_logprobs(llm, model)
    finally:
        del llm
        gc.collect()
        mp.undo()
    return out


def reload_logprobs(llm, model) -> dict[str, np.ndarray]:
    """Greedy logprobs of one prompt: before any reload; after vLLM's own `reload_weights` of the very
    same weights; after rlcheck's (`prepack_moe_on_reload` installed, the same weights again); after
    rlcheck's reload of perturbed weights, with HF's logprobs of those tokens under them."""
    from rlcheck.engines.vllm_sync import prepack_moe_on_reload

    params = vllm.SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)

    def greedy() -> tuple[np.ndarray, list[int]]:
        done = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        return np.array([d[t].logprob for d, t in zip(done.logprobs, done.token_ids, strict=True)]), list(done.token_ids)

    def reload() -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items())})
        llm.reset_prefix_cache()

    out = {"before": greedy()[0]}
    reload()
    out["vllm"] = greedy()[0]
    out["fixed_layers"] = sum(llm.apply_model(prepack_moe_on_reload))
    reload()
    out["rlcheck"] = greedy()[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.05)
    reload()
    out["updated"], tokens = greedy()
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    out["updated_hf"] = hf_side(model, prompt, tokens)[0]
    return out


def routing_of(rows) -> tuple[Routing, np.ndarray]:
    routing = Routing.from_sequences([r[1] for r in rows], [r[3] for r in rows])
    return routing, np.concatenate([r[2] - r[0] for r in rows])


@pytest.mark.slow
class TestEngineRouting:
    def test_healthy_fp32_routes_alike_and_matches_logprobs(self, runs):
        """In float32 the engine and HF pick the same experts for every response token at both layers,
        and their logprobs match to 2e-5."""
        for lp, experts, hf_lp, _ in runs["healthy"]:
            assert experts.shape == (NUM_TOKENS, 2, 2)
            np.testing.assert_allclose(lp, hf_lp, atol=LOGPROB_ATOL, rtol=0)
        routing, d = routing_of(runs["healthy"])
        s = routing_stats(routing, d)
        assert s.agree_frac == 1.0 and s.num_tokens == NUM_TOKENS * len(PROMPTS)

    def test_sync_check_fingerprints_agree(self, runs):
        """The sync check's fingerprints of the engine and the trainer agree on the MoE (its routers are
        linear layers on both sides), so the loop's weight check does not halt a healthy MoE run, nor
        one under moe-route-flip."""
        from rlcheck.core.sync_check import differing_keys

        engine, trainer = runs["fingerprints"]
        assert differing_keys(engine, trainer) == []
        # moe-route-flip is router noise in the engine's forwards, not other weights: the sync check's
        # probes of the routers see the weights as they are
        assert differing_keys(runs["fingerprint flip"], trainer) == []

    def test_reloaded_weights_reach_the_experts(self, runs):
        """vLLM 0.32's own `reload_weights` of the very same weights leaves the CPU MoE kernel reading
        unpacked expert weights as packed (logprobs off by nats); with `prepack_moe_on_reload` (what
        every rlcheck sync installs) the same reload changes nothing and new weights match HF."""
        got = runs["reload"]
        assert np.abs(got["vllm"] - got["before"]).max() > 0.1  # the vLLM bug this guards against
        assert got["fixed_layers"] == 2 and runs["prepacked"] == [True]  # so TRL's adapter takes the reload path
        np.testing.assert_allclose(got["rlcheck"], got["before"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(got["updated"], got["updated_hf"], atol=LOGPROB_ATOL, rtol=0)
        assert np.abs(got["updated"] - got["before"]).max() > 0.01  # the update took

    def test_route_flip_shows_up_in_routing_and_logprobs(self, runs):
        """Under moe-route-flip the engine's routing differs on near-tie tokens, and those tokens carry
        most of the logprob mismatch; the Monitor's metrics say so."""
        routing, d = routing_of(runs["flip"])
        s = routing_stats(routing, d)
        assert 0.0 < s.agree_frac < 1.0, s
        assert s.abs_diff_share > 0.5 and sum(s.first_diff_counts) == round((1 - s.agree_frac) * s.num_tokens)
        metrics = routing.metrics(d)
        assert metrics[K.MOE_ROUTE_AGREE_FRAC] == s.agree_frac and K.moe_layer_agree(1) in metrics


@pytest.fixture(scope="module")
def loop_run(tiny_model, ray_local, tmp_path_factory):
    """The own loop (Ray actors, vLLM, the hf trainer) on the tiny MoE under moe-route-flip=0.5: its
    run directory and its result."""
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.faults import parse_inject
    from rlcheck.loop import run_grpo
    from rlcheck.loop.presets import tiny_cpu

    run_dir = tmp_path_factory.mktemp("moe-loop") / "run"
    cfg = tiny_cpu(tiny_model("moe"), trainer="hf", world_size=1, steps=5, fault=parse_inject("moe-route-flip=0.5"))
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
        result = run_grpo(cfg, mon)
    return run_dir, result


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestLoopRouting:
    def test_the_loop_carries_both_sides_routing_and_names_the_flip(self, loop_run):
        """Every step of the loop on an MoE logs routing agreement over all its response tokens; under
        moe-route-flip the rerouted tokens carry the mismatch (a warning on most steps), the mismatch
        after every weight sync is what it was before the first (the experts' reload works), the sync
        check never fails, and diagnose names moe_routing."""
        import json

        from rlcheck.forensics.diagnose import diagnose

        run_dir, result = loop_run
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert not result.halted and len(records) == 5
        for r in records:
            m = r["metrics"]
            assert m[K.MOE_TOKEN_COUNT] == m["rlcheck/token/count"] and 0.5 < m[K.MOE_ROUTE_AGREE_FRAC] < 1.0
            assert m.get("sync/fingerprint_differs", 0.0) == 0.0
        warned = [r["step"] for r in records if any(a["metric"] == K.MOE_ABS_DIFF_SHARE for a in r["alarms"])]
        assert len(warned) >= 3 and not any(a["kind"] == "weights" for r in records for a in r["alarms"])
        # after each weight sync as before the first: had the reload left the experts packed wrong, every
        # token would be off by nats (the fingerprint's sums cannot see a packing); the rerouted stand out
        first = records[0]["metrics"][K.ABS_DIFF_MEAN]
        assert all(r["metrics"][K.ABS_DIFF_MEAN] < 2 * first for r in records[1:])
        lift = [r["metrics"][K.MOE_ABS_DIFF_LIFT] for r in records[1:] if K.MOE_ABS_DIFF_LIFT in r["metrics"]]
        assert lift and min(lift) > 2
        assert diagnose(run_dir).verdict.cause == "moe_routing"
