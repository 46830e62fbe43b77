"""Path arguments of the `rlcheck` command: every bad one is a single `rlcheck: error:` line with exit
code 2 before any work starts, and nothing is written where rlcheck refuses to write."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcheck.cli import app
from rlcheck.cli.paths import model_output, model_source, output_dir, output_file
from rlcheck.errors import PathError


def run(*args):
    """`rlcheck ARGS...` in-process (typer's CliRunner; stderr apart from stdout)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_usage_error(result, *says: str) -> None:
    """Exit 2, one `rlcheck: error:` line on stderr naming `says`, no traceback, nothing on stdout."""
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlcheck: error:"), result.stderr
    assert all(s in lines[0] for s in says), lines[0]
    assert result.stdout == "" and "Traceback" not in result.stderr


def fake_model(path: Path) -> Path:
    """A directory that looks like a Hugging Face model folder (config.json beside weights)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def notes(path: Path) -> Path:
    """A directory holding someone else's file."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("keep me")
    return path


class TestInputPaths:
    @pytest.mark.parametrize("command", [("summarize",), ("diagnose",), ("report",), ("replay",)])
    def test_missing_directory(self, tmp_path, command):
        """A run directory or dump that does not exist is named in the error."""
        assert_usage_error(run(*command, tmp_path / "nope"), "does not exist", "nope")

    @pytest.mark.parametrize("command", [("summarize",), ("diagnose",), ("report",), ("replay",)])
    def test_file_where_a_directory_is_expected(self, tmp_path, command):
        """A file given where a run directory or dump goes is refused as a file."""
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        assert_usage_error(run(*command, tmp_path / "metrics.jsonl"), "is a file, not a directory")

    def test_replay_model_must_exist(self, tmp_path):
        """replay --model pointing nowhere fails before the dump is read."""
        (tmp_path / "dump").mkdir()
        assert_usage_error(run("replay", tmp_path / "dump", "--model", tmp_path / "nope"), "--model", "does not exist")

    @pytest.mark.parametrize("command", ["stress", "sweep"])
    def test_stress_model_must_be_a_directory(self, tmp_path, command):
        """stress/sweep --model that is a file fails before vLLM starts."""
        (tmp_path / "model.bin").write_bytes(b"")
        knob = ("--knob", "max_num_seqs=1,2") if command == "sweep" else ()
        assert_usage_error(run(command, "--model", tmp_path / "model.bin", *knob), "--model", "is a file")

    def test_demo_model_that_is_no_model(self, tmp_path):
        """demo --model naming a non-empty folder without config.json is refused (it would not be built over)."""
        assert_usage_error(run("demo", "--model", notes(tmp_path / "m"), "--run-dir", tmp_path / "run"),
                           "neither a model folder")
        assert not (tmp_path / "run").exists()


class TestOutputPaths:
    def test_run_dir_that_is_a_file(self, tmp_path):
        """demo --run-dir naming a file is refused."""
        (tmp_path / "run").write_text("x")
        assert_usage_error(run("demo", "--synthetic", "--run-dir", tmp_path / "run"), "is a file, not a directory")

    def test_run_dir_below_a_file(self, tmp_path):
        """A directory to create under a file cannot be made: refused up front."""
        (tmp_path / "f").write_text("x")
        assert_usage_error(run("demo", "--synthetic", "--run-dir", tmp_path / "f" / "run"), "is a file")

    def test_non_empty_foreign_dir_is_not_written_into(self, tmp_path):
        """demo --run-dir on a directory holding other files is refused and the files are untouched."""
        target = notes(tmp_path / "other")
        assert_usage_error(run("demo", "--synthetic", "--run-dir", target), "is not empty")
        assert [p.name for p in target.iterdir()] == ["notes.txt"]

    def test_stress_out_over_foreign_files_is_refused(self, tmp_path):
        """stress replaces its --out directory whole: one holding anything but an earlier stress result is refused."""
        model, target = fake_model(tmp_path / "m"), notes(tmp_path / "keep")
        assert_usage_error(run("stress", "--model", model, "--out", target), "is not empty", "stress.json")
        assert (target / "notes.txt").read_text() == "keep me"

    def test_sweep_out_that_is_a_file(self, tmp_path):
        """sweep --out naming a file is refused."""
        model = fake_model(tmp_path / "m")
        (tmp_path / "out").write_text("x")
        assert_usage_error(run("sweep", "--model", model, "--knob", "max_num_seqs=1,2", "--out", tmp_path / "out"),
                           "is a file")

    def test_output_inside_a_model_folder(self, tmp_path):
        """A run directory inside a model folder is refused, naming the model folder."""
        model = fake_model(tmp_path / "model")
        assert_usage_error(run("demo", "--synthetic", "--run-dir", model / "runs" / "x"), "inside the model folder")
        assert not (model / "runs").exists()

    def test_report_out_is_a_directory(self, tmp_path):
        """report --out naming a directory asks for a file name."""
        (tmp_path / "run").mkdir()
        assert_usage_error(run("report", tmp_path / "run", "--out", tmp_path), "is a directory")

    def test_report_does_not_replace_other_files(self, tmp_path):
        """report --out naming an existing non-HTML file is refused and the file kept."""
        (tmp_path / "run").mkdir()
        (tmp_path / "README.md").write_text("mine")
        assert_usage_error(run("report", tmp_path / "run", "--out", tmp_path / "README.md"), "not a .html")
        assert (tmp_path / "README.md").read_text() == "mine"

    def test_make_model_force_replaces_only_its_own_models(self, tmp_path):
        """make-model --force on a folder make-model did not build is refused, its files kept."""
        target = notes(tmp_path / "home")
        assert_usage_error(run("make-model", target, "--arch", "llama"), "not empty", "--force")
        assert_usage_error(run("make-model", target, "--arch", "llama", "--force"), "rlcheck_model.json")
        assert (target / "notes.txt").read_text() == "keep me"

    @pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
    def test_unwritable_parent(self, tmp_path):
        """An output whose nearest existing parent is not writable is refused."""
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        try:
            assert_usage_error(run("demo", "--synthetic", "--run-dir", locked / "run"), "not writable")
        finally:
            locked.chmod(0o700)


class TestOutputDir:
    def test_accepts_new_empty_and_own_output(self, tmp_path):
        """Missing, empty, and a directory holding the command's own earlier result are fine."""
        (tmp_path / "empty").mkdir()
        (tmp_path / "again").mkdir()
        (tmp_path / "again" / "stress.json").write_text(json.dumps({}))
        for path in (tmp_path / "new" / "deeper", tmp_path / "empty", tmp_path / "again"):
            assert output_dir(path, "--out", own_marker="stress.json") == path

    def test_refuses_a_run_dir_for_another_command(self, tmp_path):
        """A directory with someone else's files (here: a stress result, for sweep) is refused."""
        (tmp_path / "s").mkdir()
        (tmp_path / "s" / "stress.json").write_text("{}")
        with pytest.raises(PathError, match="not empty"):
            output_dir(tmp_path / "s", "--out", own_marker="sweep.json")

    def test_config_json_alone_is_no_model_folder(self, tmp_path):
        """A project directory with a config.json but no weights does not count as a model folder."""
        (tmp_path / "config.json").write_text("{}")
        assert output_dir(tmp_path / "runs" / "x", "--run-dir") == tmp_path / "runs" / "x"


class TestOutputFile:
    def test_html_may_be_replaced(self, tmp_path):
        """An earlier report (an .html file) may be written over; None passes through."""
        (tmp_path / "r.html").write_text("<html>")
        assert output_file(tmp_path / "r.html", "--out") == tmp_path / "r.html"
        assert output_file(None, "--out") is None


class TestModelPaths:
    def test_own_model_may_be_forced(self, tmp_path):
        """--force may replace a folder that holds make-model's manifest."""
        model = fake_model(tmp_path / "m")
        (model / "rlcheck_model.json").write_text("{}")
        assert model_output(model, force=True) == model
        with pytest.raises(PathError, match="--force"):
            model_output(model, force=False)

    def test_model_source_missing_empty_or_model(self, tmp_path):
        """A model to load or build: a model folder, an empty folder or a new path pass."""
        (tmp_path / "empty").mkdir()
        for path in (fake_model(tmp_path / "m"), tmp_path / "empty", tmp_path / "new"):
            assert model_source(path, "--model") == path
