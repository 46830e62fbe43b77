"""The `rlcheck` command as a user runs it: help, the synthetic demo, summarize, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RLCHECK = str(Path(sys.executable).with_name("rlcheck"))


def rlcheck(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run([RLCHECK, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.slow
class TestCLI:
    def test_help_lists_commands(self):
        """`rlcheck --help` names the commands."""
        out = rlcheck("--help")
        assert out.returncode == 0
        assert "summarize" in out.stdout and "demo" in out.stdout

    def test_demo_finds_the_injected_period(self, tmp_path):
        """The demo halts on a periodic alarm naming period 12 and leaves a dump behind."""
        out = rlcheck("demo", "--run-dir", str(tmp_path / "demo"))
        assert out.returncode == 0, out.stderr
        assert "found: period 12, phase 0" in out.stdout
        assert "halted after" in out.stdout
        dumps = list((tmp_path / "demo" / "dumps").glob("step_*"))
        assert len(dumps) == 1 and (dumps[0] / "sequences.parquet").is_file()

    def test_demo_default_run_dir_is_new_each_time(self, tmp_path):
        """Without --run-dir the demo writes under runs/ in a fresh directory."""
        out = rlcheck("demo", "--steps", "5", cwd=tmp_path)
        assert out.returncode == 1  # five steps are too few to see a period: the demo says so
        assert "no periodic alarm" in out.stdout
        assert len(list((tmp_path / "runs").glob("demo-*"))) == 1

    def test_summarize_json(self, tmp_path):
        """`summarize --json` reports steps, the periodic alarm and the dump."""
        rlcheck("demo", "--run-dir", str(tmp_path / "d"))
        out = rlcheck("summarize", str(tmp_path / "d"), "--json")
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout)
        assert summary["num_steps"] > 60
        assert [a["kind"] for a in summary["alarms"]][0] == "periodic"
        assert len(summary["dumps"]) == 1
        table = rlcheck("summarize", str(tmp_path / "d"))
        assert "alarms" in table.stdout and "periodic" in table.stdout

    def test_summarize_errors_are_one_line(self, tmp_path):
        """A missing directory or one without metrics.jsonl is a short error with exit code 2."""
        missing = rlcheck("summarize", str(tmp_path / "nope"))
        assert missing.returncode == 2 and "does not exist" in missing.stderr
        (tmp_path / "empty").mkdir()
        empty = rlcheck("summarize", str(tmp_path / "empty"))
        assert empty.returncode == 2 and "rlcheck: error:" in empty.stderr and "Traceback" not in empty.stderr
