"""The `rlcheck` command as a user runs it: help, the demos (real loop and synthetic), summarize, and
clear errors."""

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
        """The synthetic demo halts on a periodic alarm naming period 12 and leaves a dump behind."""
        out = rlcheck("demo", "--synthetic", "--run-dir", str(tmp_path / "demo"))
        assert out.returncode == 0, out.stderr
        assert "found: period 12, phase 0" in out.stdout
        assert "halted after" in out.stdout
        dumps = list((tmp_path / "demo" / "dumps").glob("step_*"))
        assert len(dumps) == 1 and (dumps[0] / "sequences.parquet").is_file()

    def test_demo_default_run_dir_is_new_each_time(self, tmp_path):
        """Without --run-dir the demo writes under runs/ in a fresh directory."""
        out = rlcheck("demo", "--synthetic", "--steps", "5", cwd=tmp_path)
        assert out.returncode == 1  # five steps are too few to see a period: the demo says so
        assert "no periodic alarm" in out.stdout
        assert len(list((tmp_path / "runs").glob("demo-*"))) == 1

    def test_summarize_json(self, tmp_path):
        """`summarize --json` reports steps, the periodic alarm and the dump."""
        rlcheck("demo", "--synthetic", "--run-dir", str(tmp_path / "d"))
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


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestRealDemo:
    def test_clean_demo_runs_the_loop(self, tmp_path, tiny_model):
        """`rlcheck demo` runs real GRPO steps on Ray, logs JSONL and a W&B offline run, and says healthy."""
        from rlcheck.sinks.testing import read_offline_run

        run = tmp_path / "demo"
        out = rlcheck("demo", "--run-dir", str(run), "--model", str(tiny_model("hybrid")), "--steps", "4",
                      "--trainer", "deepspeed")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "healthy: 4 steps, no alarm" in out.stdout and "median seconds per step" in out.stdout
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        (wandb_run,) = (run / "wandb").glob("offline-run-*")
        logged = read_offline_run(wandb_run)
        history = {r["history"]["step"].get("num", 0): r["history"]["item"] for r in logged if r["type"] == "history"}
        assert sorted(history) == [0, 1, 2, 3]
        for r in records:
            assert history[r["step"]]["rlcheck/token/abs_diff_mean"] == pytest.approx(r["metrics"]["rlcheck/token/abs_diff_mean"])
            assert history[r["step"]]["loop/reward_mean"] == pytest.approx(r["metrics"]["loop/reward_mean"])

    def test_demo_builds_its_model(self, tmp_path):
        """With no model folder yet, the demo builds the tiny hybrid model first (one step, hf trainer, no W&B)."""
        out = rlcheck("demo", "--run-dir", str(tmp_path / "d"), "--model", str(tmp_path / "m"), "--steps", "1",
                      "--trainer", "hf", "--no-wandb")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "d" / "metrics.jsonl").is_file()

    @pytest.mark.parametrize(("option", "value", "says"), [
        ("--inject", "skip-sync-every=1", "K >= 2"),
        ("--inject", "melt-gpu=3", "unknown fault"),
        ("--trainer", "megatron", "not one of"),
    ])
    def test_bad_options_fail_before_ray_starts(self, tmp_path, option, value, says):
        """A bad fault or trainer name is a one-line error (exit 2) and no run directory is made."""
        out = rlcheck("demo", "--run-dir", str(tmp_path / "d"), option, value)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
        assert not (tmp_path / "d").exists()
