"""The loop's driver (`rlcheck.loop.driver.GRPOLoop`): the order its actors start in, with stand-ins
for the Ray actors (the real order runs in every integration test of the loop)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


class TestStartOrder:
    def _loop(self, tiny_model, tmp_path, monkeypatch, events: list, engine_fails: bool = False):
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

        monkeypatch.setattr(group_module, "TrainerGroup", Group)
        monkeypatch.setattr(recovery, "RolloutSupervisor", Supervisor)
        monkeypatch.setattr(resources, "check_cluster", lambda *a: None)
        monitor = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",)))
        try:
            GRPOLoop(tiny_cpu(tiny_model("llama"), steps=1), monitor)
        finally:
            monitor.close()

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
