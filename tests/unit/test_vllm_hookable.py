"""How an engine the guard or an engine fault will hook is built: `vllm_faults.hookable_settings`
(eager, vLLM's V1 model runner, one line saying so), when `VLLMEngine` applies it, and the GPU
recipes asking for it with an engine fault."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from rlcheck.engines.vllm_faults import HOOKABLE_ENV, hookable_settings


class TestHookableSettings:
    def test_graphs_and_v2_runner_turned_off(self):
        """CUDA graphs on and no runner choice: eager, V1 runner, and the line names both and why."""
        kwargs = {"model": "m", "enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL"}}
        out, env, note = hookable_settings(kwargs, {})
        assert out == {**kwargs, "enforce_eager": True, "async_scheduling": False}
        assert kwargs["enforce_eager"] is False  # the caller's dict is left alone
        assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        assert "enforce_eager=True" in note and "VLLM_USE_V2_MODEL_RUNNER=0" in note and "V2 runner" in note
        assert "async_scheduling=False" in note

    def test_nothing_to_change_says_nothing(self):
        """Already eager with the V1 runner chosen: same kwargs, nothing to set, no line."""
        out, env, note = hookable_settings({"enforce_eager": True, "async_scheduling": False}, dict(HOOKABLE_ENV))
        assert out == {"enforce_eager": True, "async_scheduling": False} and env == {} and note is None

    def test_v2_runner_asked_for_is_overridden(self):
        """VLLM_USE_V2_MODEL_RUNNER=1 in the environment: set back to 0 (the hooks cannot work on V2)."""
        _, env, note = hookable_settings({"enforce_eager": True, "async_scheduling": False},
                                         {"VLLM_USE_V2_MODEL_RUNNER": "1"})
        assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and "enforce_eager" not in note


@pytest.mark.slow  # imports vLLM (~10-40 s); starts no engine
class TestBuildLLM:
    @pytest.fixture
    def built(self, tmp_path, monkeypatch):
        """`build(**config) -> kwargs`: what `build_llm` hands `vllm.LLM` (recorded, no engine started)."""
        vllm = pytest.importorskip("vllm")
        from rlcheck.engines import vllm as engine
        from rlcheck.engines.vllm_env import build_llm

        seen = []
        monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.append({**kwargs, "env cache space": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}))
        for name in (*HOOKABLE_ENV, "RLCHECK_BREAK_ON"):  # unset now and after the test, however it leaves them
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)

        def build(**config):
            build_llm(engine.VLLMConfig(model=str(tmp_path), enforce_eager=False, **config))
            return seen.pop()

        return build

    def test_a_configured_cache_size_wins_over_the_cpu_variable(self, built, monkeypatch, capsys):
        """VLLM_CPU_KVCACHE_SPACE (which vLLM's CPU backend lets win) is left out while an engine with
        kv_cache_bytes starts, said on stderr, and restored after; without kv_cache_bytes it stays."""
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        got = built(kv_cache_bytes=8 << 20)
        assert got["kv_cache_memory_bytes"] == 8 << 20 and got["env cache space"] is None
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_CPU_KVCACHE_SPACE=1 left out" in capsys.readouterr().err
        assert built()["env cache space"] == "1"

    def test_an_untested_vllm_warns_once_at_start(self, built, monkeypatch):
        """An engine started on a vLLM outside the tested range warns once, naming the range; the tested
        one is silent."""
        from rlcheck import versions

        monkeypatch.setattr(versions, "_warned", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built()
            monkeypatch.setattr(versions, "installed", lambda package: "0.40.1")
            built()
            built()
        said = [str(w.message) for w in caught if "rlcheck's vLLM engine" in str(w.message)]
        assert len(said) == 1 and "vllm 0.40.1" in said[0] and versions.TESTED["vllm"].describe() in said[0]

    def test_plain_engine_untouched(self, built):
        """No guard, no fault: the kwargs as configured, the runner left to vLLM."""
        import os

        assert built()["enforce_eager"] is False
        assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ

    @pytest.mark.parametrize("why", ["fault", "guard"])
    def test_guard_or_fault_made_hookable(self, built, why, capsys):
        """With a guard or for a fault: eager, VLLM_USE_V2_MODEL_RUNNER=0 set, one line on stderr."""
        import os

        from rlcheck.engines.guard import GuardConfig

        assert built(**({"hookable": True} if why == "fault" else {"guard": GuardConfig()}))["enforce_eager"] is True
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        assert capsys.readouterr().err.count("rlcheck: vLLM engine built with") == 1


class TestGPURecipe:
    def test_engine_fault_asks_for_a_hookable_engine(self):
        """`--inject` with an engine fault sets `hookable`; a loop-level fault or none leaves it off."""
        recipes = str(Path(__file__).resolve().parents[2] / "recipes")
        sys.path.insert(0, recipes)
        try:
            import _gpu_common
        finally:
            sys.path.remove(recipes)
        ap = _gpu_common.parser("GPU recipe")
        hookable = {inject: _gpu_common.loop_config(ap.parse_args(["--model", "m", *inject]), "fsdp2").rollout.hookable
                    for inject in (("--inject", "stale-state"), ("--inject", "skip-sync-every=4"), ())}
        assert hookable == {("--inject", "stale-state"): True, ("--inject", "skip-sync-every=4"): False, (): False}


class TestForensicEngines:
    def test_stress_and_localize_ask_for_a_hookable_engine(self, tmp_path, monkeypatch):
        """`rlcheck stress` (its slot trace, faults, guard) and `rlcheck localize` (its layer hooks) build
        their engines hookable, so on CUDA vLLM 0.32 cannot pick its V2 runner under them."""
        from rlcheck.engines import vllm as engine
        from rlcheck.forensics import stress
        from rlcheck.forensics.localize import engine as localize_engine

        cfg = stress.StressConfig(model=str(tmp_path))
        assert stress.engine_config(cfg).hookable
        built = []
        monkeypatch.setattr(engine, "VLLMEngine", lambda config: built.append(config))
        localize_engine.forced_engine({"context": {}}, tmp_path, "float32", 64)
        assert built and built[0].hookable


class TestEngineEnv:
    def test_fp32_on_cuda_gets_ieee_triton_dots(self, capsys):
        """A float32 engine on CUDA: TRITON_F32_DEFAULT=ieee (Triton's tl.dot would run TF32), one stderr
        line; a bf16 engine, a CPU host or the user's own setting: nothing changed, nothing said."""
        from rlcheck.engines.vllm_env import engine_env

        env: dict[str, str] = {}
        engine_env("float32", 1, cuda=True, environ=env)
        assert env["TRITON_F32_DEFAULT"] == "ieee" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert capsys.readouterr().err.count("TRITON_F32_DEFAULT=ieee") == 1
        for dtype, cuda, given in (("bfloat16", True, {}), ("float32", False, {}), ("float32", True, {"TRITON_F32_DEFAULT": "tf32"})):
            env = dict(given)
            engine_env(dtype, 1, cuda=cuda, environ=env)
            assert env.get("TRITON_F32_DEFAULT") == given.get("TRITON_F32_DEFAULT")
        assert capsys.readouterr().err == ""
        env = {}
        engine_env("bfloat16", 2, cuda=False, environ=env)
        assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
