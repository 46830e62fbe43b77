"""Tests of rlcheck.sinks.make_sinks and the package's import-time promises."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlcheck.errors import ConfigError
from rlcheck.sinks import ConsoleSink, make_sinks


class TestMakeSinks:
    def test_builds_in_order(self, tmp_path):
        """Named sinks are built in the order given; "jsonl" names the Run's journal and builds no sink."""
        fan = make_sinks(["console", "jsonl"], tmp_path)
        assert [type(s) for s in fan.sinks] == [ConsoleSink]
        fan.close()

    def test_unknown_name(self, tmp_path):
        """An unknown sink name is a ConfigError that lists the valid names."""
        with pytest.raises(ConfigError, match="jsonl, console, wandb"):
            make_sinks(["jsonl", "tensorboard"], tmp_path)

    @pytest.mark.parametrize("names", ["jsonl", ["jsonl", "jsonl"]])
    def test_bad_name_list(self, tmp_path, names):
        """A bare string or a repeated name is a ConfigError."""
        with pytest.raises(ConfigError):
            make_sinks(names, tmp_path)

    def test_no_heavy_imports(self):
        """Importing rlcheck.sinks imports neither wandb nor rich."""
        code = "import sys, rlcheck.sinks; print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'rich'}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "[]"
