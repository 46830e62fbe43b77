"""Both sides' routing readers: the trainer's router hooks on a real (tiny, random) HF Qwen3-MoE, the
response-row alignment, vLLM's `routed_experts` parsing and the near-tie flip of the fault."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.engines.moe_routing import flip_near_ties, moe_gates, response_rows, routed_experts_response
from rlcheck.errors import ConfigError, InputError

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf_moe():
    """A tiny random HF Qwen3-MoE (2 layers, 8 experts, top-2), built from its config in memory."""
    from rlcheck.modelzoo.models import hf_config, init_model

    return init_model(hf_config("moe", 512, 2, {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}), 0, 3.0)


class TestRouteRecorder:
    def test_matches_output_router_logits(self, hf_moe):
        """The experts the hooks record are the top-2 of HF's own router logits, per layer and token."""
        from rlcheck.trainers.moe_routing import RouteRecorder

        ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
        with RouteRecorder(hf_moe) as routes, torch.no_grad():
            out = hf_moe(ids, output_router_logits=True)
        got = routes.experts(tuple(ids.shape))  # (2, 9, 2, 2)
        assert got.shape == (2, 9, 2, 2)
        for layer, logits in enumerate(out.router_logits):  # (18, 8) each
            want = np.sort(logits.topk(2, dim=-1).indices.numpy(), axis=-1).reshape(2, 9, 2)
            np.testing.assert_array_equal(np.sort(got[:, :, layer], axis=-1), want)

    def test_same_forward_as_the_logprobs(self, hf_moe):
        """Recording around `token_logprobs` (the chunked trainer forward) routes each token once: no
        second pass, and the same experts as a plain forward."""
        from rlcheck.trainers.logprobs import token_logprobs
        from rlcheck.trainers.moe_routing import RouteRecorder

        ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(1))
        with RouteRecorder(hf_moe) as plain, torch.no_grad():
            hf_moe(ids)
        with RouteRecorder(hf_moe) as routes, torch.no_grad():
            token_logprobs(hf_moe, ids)
        np.testing.assert_array_equal(routes.experts(), plain.experts())
        assert routes.experts().shape == (12, 2, 2)
        routes.clear()
        assert routes.experts().shape == (0, 2, 2)

    def test_dense_model_is_a_config_error(self):
        """A model without MoE routers is refused, naming what routing needs."""
        from rlcheck.modelzoo.models import hf_config, init_model

        dense = init_model(hf_config("llama", 512, 2, {}), 0, 3.0)
        with pytest.raises(ConfigError, match="MoE router"):
            moe_gates(dense)


class TestResponseRows:
    def test_takes_the_rows_that_predicted_the_response(self):
        """Response token i after P prompt tokens is routed at position P - 1 + i."""
        experts = np.arange(7 * 2 * 2).reshape(7, 2, 2)
        got = response_rows(experts, np.arange(7), prompt_len=4, num_tokens=3)
        np.testing.assert_array_equal(got, experts[3:6])

    def test_missing_positions_are_an_input_error(self):
        """Positions the capture never saw (a cached prompt) are named, not silently misaligned."""
        with pytest.raises(InputError, match="response needs 3..5"):
            response_rows(np.zeros((3, 2, 2)), np.array([4, 5, 6]), prompt_len=4, num_tokens=3)

    def test_parses_vllm_routed_experts(self):
        """vLLM's [positions, layers, top_k] `routed_experts` gives the response's rows; a flat array is refused."""
        routed = np.arange(10 * 48 * 8).reshape(10, 48, 8)
        got = routed_experts_response(routed.tolist(), prompt_len=6, num_tokens=4)
        assert got.dtype == np.int64 and got.shape == (4, 48, 8)
        np.testing.assert_array_equal(got, routed[5:9])
        with pytest.raises(InputError, match="positions, layers, top_k"):
            routed_experts_response(routed.reshape(10, -1), 6, 4)


class TestFlipNearTies:
    def test_flips_only_near_ties(self):
        """frac=1 swaps the 2nd and 3rd experts of the rows whose gap is under near_tie, no other row."""
        logits = torch.tensor([[3.0, 2.0, 1.99, 0.0], [3.0, 2.0, 1.0, 0.0]])
        out = flip_near_ties(logits, 2, 1.0, 0.05, torch.Generator().manual_seed(0))
        assert set(out[0].topk(2).indices.tolist()) == {0, 2}
        assert set(out[1].topk(2).indices.tolist()) == {0, 1}
        assert logits[0, 2] == 1.99  # the input is left alone
        none = flip_near_ties(logits, 2, 0.0, 0.05, torch.Generator().manual_seed(0))
        assert torch.equal(none, logits)


class TestMoeRouteFlipFault:
    def test_parses_into_an_engine_fault(self):
        """`moe-route-flip=P` is an engine fault whose cause diagnose knows; P outside (0, 1] is refused."""
        from rlcheck.faults import parse_inject
        from rlcheck.forensics.diagnose.findings import CAUSES

        fault = parse_inject("moe-route-flip=0.2")
        assert fault.engine_fault() == ("moe-route-flip", {"flip": 0.2}) and fault.cause in CAUSES
        assert fault.describe() == "moe-route-flip=0.2"
        with pytest.raises(ConfigError, match="moe-route-flip"):
            parse_inject("moe-route-flip=0")

    def test_inject_needs_flip(self):
        """`inject` takes `flip` for moe-route-flip and only there."""
        from rlcheck.engines.vllm_faults import inject

        with pytest.raises(ConfigError, match="flip is required"):
            inject(object(), "moe-route-flip")


class TestRoutingPlan:
    """How an engine records MoE routing (`rlcheck.engines.moe_capture.routing_plan`)."""

    def test_auto_follows_the_model_and_the_runner(self, tiny_model):
        """"auto": router hooks for an MoE on the V1 runner (CPU, or hookable on CUDA), vLLM's
        routed_experts on CUDA's V2 runner, nothing for a dense model or a tensor-parallel CPU engine."""
        from rlcheck.engines.guard import GuardConfig
        from rlcheck.engines.moe_capture import routing_plan
        from rlcheck.engines.vllm import VLLMConfig

        moe, dense = str(tiny_model("moe")), str(tiny_model("llama"))
        assert routing_plan(VLLMConfig(model=moe), cuda=False) == "hooks"
        assert routing_plan(VLLMConfig(model=moe), cuda=True) == "vllm"
        assert routing_plan(VLLMConfig(model=moe, hookable=True), cuda=True) == "hooks"
        assert routing_plan(VLLMConfig(model=moe, guard=GuardConfig()), cuda=True) == "hooks"
        assert routing_plan(VLLMConfig(model=moe, tensor_parallel_size=2), cuda=False) == "off"
        assert routing_plan(VLLMConfig(model=moe, moe_routing="off"), cuda=False) == "off"
        assert routing_plan(VLLMConfig(model=dense), cuda=False) == "off"

    def test_on_where_it_cannot_be_is_refused(self, tiny_model):
        from rlcheck.engines.moe_capture import routing_plan
        from rlcheck.engines.vllm import VLLMConfig

        moe = str(tiny_model("moe"))
        with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
            routing_plan(VLLMConfig(model=moe, moe_routing="on", tensor_parallel_size=2), cuda=False)
        with pytest.raises(ConfigError, match="enforce_eager=True"):
            routing_plan(VLLMConfig(model=moe, moe_routing="on", enforce_eager=False), cuda=False)
        with pytest.raises(ConfigError, match="moe_routing must be"):
            VLLMConfig(model=moe, moe_routing="yes")


class _CudaV2LLM:
    """Stands in for `vllm.LLM` on CUDA's V2 runner (`enable_return_routed_experts`): `generate` returns
    vLLM's own `RequestOutput` / `CompletionOutput` objects, each completion's `routed_experts` made by
    `routed(num_positions)`."""

    def __init__(self, routed):
        self.routed = routed

    def generate(self, prompts, params, use_tqdm=False):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        out = []
        for i, p in enumerate(prompts):
            prompt, ids = p["prompt_token_ids"], [5, 6, 7]
            logprobs = [{t: Logprob(-0.5)} for t in ids]
            c = CompletionOutput(0, "", ids, -1.5, logprobs, routed_experts=self.routed(len(prompt) + len(ids)),
                                 finish_reason="length")
            out.append(RequestOutput(str(i), None, prompt, None, [c], True))
        return out


class TestVllmRoutedExperts:
    """A CUDA engine reads vLLM's `routed_experts`; where it is missing or laid out otherwise, the
    rollouts go on without routing, said once: never a failed rollout for a monitor's sake."""

    def engine(self, tiny_model, monkeypatch, routed):
        import rlcheck.engines.vllm as V

        monkeypatch.setattr(V, "build_llm", lambda cfg: _CudaV2LLM(routed))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return V.VLLMEngine(V.VLLMConfig(model=str(tiny_model("moe"))))

    def test_vllms_layout_is_read(self, tiny_model, monkeypatch):
        """[positions, layers, top_k]: each rollout's experts are the rows that routed its tokens."""
        engine = self.engine(tiny_model, monkeypatch, lambda n: np.arange(n * 4).reshape(n, 2, 2))
        assert engine.routes.plan == "vllm"
        (r,) = engine.generate([[1, 2, 3, 4]], step=0)
        np.testing.assert_array_equal(r.experts, np.arange(7 * 4).reshape(7, 2, 2)[3:6])

    @pytest.mark.parametrize("routed", [
        lambda n: None,  # the runner did not record them
        lambda n: np.zeros((n, 4), np.int64),  # flattened layers x top_k
        lambda n: np.zeros((2, n, 2), np.int64),  # layer-major
        lambda n: np.zeros((n, 2, 3), np.int64),  # top_k axis of another size
        lambda n: [[[0, 1]]] * 2,  # too few positions
    ], ids=["none", "flat", "layer_major", "top_k", "short"])
    def test_missing_or_other_layout_degrades(self, tiny_model, monkeypatch, routed):
        """The rollouts come back whole with experts None, one warning for the engine (none the next call);
        before, every rollout raised TypeError or InputError."""
        engine = self.engine(tiny_model, monkeypatch, routed)
        with pytest.warns(RuntimeWarning, match="MoE routing not available") as said:
            rollouts = engine.generate([[1, 2, 3, 4], [1, 2]], step=0)
        assert len(said) == 1 and [len(r.token_ids) for r in rollouts] == [3, 3]
        assert all(r.experts is None for r in rollouts) and engine.routes.unavailable == 2
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert engine.generate([[1, 2, 3]], step=1)[0].experts is None
