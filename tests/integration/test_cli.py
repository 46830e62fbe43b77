"""The `rlcheck` command as a user runs it: help, the demos (real loop and synthetic), summarize, diagnose,
and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import MismatchHalt
from rlcheck.faults import parse_inject
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

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


def record_run(run_dir: Path, spec: str | None = None, steps: int = 45) -> Path:
    """A run directory the Monitor writes from the synthetic stream with the fault `spec` applied (until a halt)."""
    fault, data = parse_inject(spec), SyntheticConfig(num_sequences=64, mean_length=64)
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
        for step in range(steps):
            try:
                mon.observe(step, fault.apply(step, synthetic_batch(data, step))[0])
            except MismatchHalt:
                break
    return run_dir


@pytest.mark.slow
class TestDiagnoseCLI:
    def test_healthy_run_exits_0(self, tmp_path):
        """A clean run: exit code 0 and a healthy verdict over all its steps in the JSON."""
        out = rlcheck("diagnose", str(record_run(tmp_path / "run")), "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["verdict"]["cause"] == "healthy" and result["num_steps"] == 45

    def test_cause_found_exits_1(self, tmp_path):
        """An off-by-one from step 32: exit code 1, token misalignment in the JSON and in the text output."""
        run = record_run(tmp_path / "run", "off-by-one@32")
        out = rlcheck("diagnose", str(run), "--json")
        assert out.returncode == 1, out.stderr
        verdict = json.loads(out.stdout)["verdict"]
        assert verdict["cause"] == "token_misalignment" and verdict["affected_steps"] == [32]
        text = rlcheck("diagnose", str(run))
        assert text.returncode == 1 and "likely cause: token misalignment" in text.stdout

    def test_dump_directory(self, tmp_path):
        """The halt dump on its own is diagnosed as a one-step dump with the same cause (exit code 1)."""
        run = record_run(tmp_path / "run", "off-by-one@32")
        out = rlcheck("diagnose", str(run / "dumps" / "step_000032"), "--json")
        assert out.returncode == 1, out.stderr
        result = json.loads(out.stdout)
        assert result["source"] == "dump" and result["verdict"]["cause"] == "token_misalignment"

    def test_not_a_run_exits_2(self, tmp_path):
        """A directory that is neither a run nor a dump: exit code 2, one "rlcheck: error:" line, no traceback."""
        (tmp_path / "notes.txt").write_text("hello")
        out = rlcheck("diagnose", str(tmp_path), "--json")
        assert out.returncode == 2 and out.stdout == ""
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlcheck: error:") and "neither a run directory" in lines[0]
        missing = rlcheck("diagnose", str(tmp_path / "nope"))
        assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


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

    def test_demo_quarantines_instead_of_halting(self, tmp_path):
        """`rlcheck demo --quarantine --inject corrupt-seqs=0.1 --correction token`: 3 steps, no halt, each
        step's corrupted sequences (6 of 64) quarantined, no other (the random model finds gibberish
        improbable). With no model folder yet, the demo builds the tiny random hybrid there first."""
        run = tmp_path / "d"
        out = rlcheck("demo", "--run-dir", str(run), "--model", str(tmp_path / "m"), "--steps", "3",
                      "--trainer", "hf", "--no-wandb", "--quarantine", "--inject", "corrupt-seqs=0.1",
                      "--correction", "token")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert (tmp_path / "m" / "config.json").is_file()
        text = " ".join(out.stdout.split())
        lines = [json.loads(x) for x in (run / "loop.jsonl").read_text().splitlines()]
        assert all({q["request_id"] for q in x["quarantined"]} == set(x["fault_touched"]) and "correction" in x
                   for x in lines)
        n = sum(len(x["fault_touched"]) for x in lines)
        assert f"quarantined {n} sequence(s) ({n} catastrophic) over 3 steps" in text
        assert f"of the {n} the fault corrupted, {n} quarantined" in text and "halted after" not in text
        assert all(x["dropped_tokens"] > 0 and "rollout_is_eff_sample_size" in x["correction"] for x in lines)
        assert sorted(p.name for p in (run / "quarantine").iterdir()) == [f"step_{s:06d}" for s in range(3)]
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert all(r["metrics"]["rlcheck/quarantine/count"] == len(x["fault_touched"]) > 0
                   and r["metrics"]["rlcheck/seq/catastrophic_count"] == 0  # judged on the kept sequences
                   for r, x in zip(records, lines, strict=True))

    @pytest.mark.parametrize(("option", "value", "says"), [
        ("--correction", "tokens", "not token, sequence or geometric"),
        ("--inject", "skip-sync-every=1", "K >= 2"),
        ("--inject", "melt-gpu=3", "unknown fault"),
        ("--trainer", "megatron", "not one of"),
    ])
    def test_bad_options_fail_before_ray_starts(self, tmp_path, option, value, says):
        """A bad fault or trainer name is a one-line error (exit 2) and no run directory is made."""
        out = rlcheck("demo", "--run-dir", str(tmp_path / "d"), option, value)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
        assert not (tmp_path / "d").exists()
