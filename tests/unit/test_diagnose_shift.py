"""Diagnose's engine-shift rule (`rlcheck.forensics.diagnose.rules.shift`) on recorded run directories of verl's
real trainer (tests/data/verl_runs: the resumed legacy run of tests/integration/test_verl_trainer.py, three
recordings of `stop-token@3` then `perturb-layer=1@5`), and on those records changed where the rule must
stay silent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlcheck.core import metrics as K
from rlcheck.forensics.diagnose import diagnose
from rlcheck.forensics.diagnose.rules.shift import SHIFT

RECORDED = Path(__file__).resolve().parents[1] / "data" / "verl_runs"
RUNS = ("perturbed-layer-a", "perturbed-layer-b", "perturbed-layer-c", "perturbed-layer-d")
"""a: clean 0.008-0.011, steps 6 and 7 at 0.147 and 0.131 (clipped mean |d|); b: 0.098 and 0.070, step 7
sloped (a `systematic_slope` alarm); c: 0.091 and 0.090, a journal of before the precision floors (no
`rlcheck/floor/level`); d: ~0.08 at steps 6 and 7, their median token |d| only 0.084 to 0.097 of the mean
(a confident model: most tokens barely move) but over every clean step's median (`make test-verl` failed on
it before)."""


def findings(run_dir: Path) -> dict[str, object]:
    return {f.cause: f for f in diagnose(run_dir).findings}


@pytest.mark.parametrize("name", RUNS)
def test_perturbed_layer_named_beside_the_stop_token(name):
    """Both incidents of one verl run directory: the stop token at step 3 stays the verdict; the engine
    computing otherwise from step 6 on (versions in order) is reported, with the localize command, above
    the weaker names the level alone gave before (numeric noise over every step, a temperature slope on one)."""
    result = diagnose(RECORDED / name)
    assert result.verdict.cause == "stop_token" and result.verdict.affected_steps == [3]
    causes = [f.cause for f in result.findings]
    assert causes[1] == "engine_shift", causes
    shift = result.findings[1]
    assert shift.affected_steps == [6, 7]
    assert "weights lag 0" in shift.evidence[1] and "rlcheck localize" in shift.evidence[2]


def test_cli_says_also_possible(tmp_path):
    from typer.testing import CliRunner

    from rlcheck.cli import app

    out = CliRunner().invoke(app, ["diagnose", str(RECORDED / RUNS[0])], terminal_width=400)
    assert "likely cause: stop token" in out.output
    assert "also possible: the engine computes otherwise from one step on" in out.output


def edited(tmp_path: Path, name: str, edit) -> Path:
    """A copy of recorded run `name` whose records `edit(record)` changed (in place)."""
    run_dir = tmp_path / name
    shutil.copytree(RECORDED / name, run_dir)
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        edit(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_silent_when_a_version_lags(tmp_path):
    """A step past the shift tagged with older weights: the weights rules' case, not this one."""
    def lag(r):
        if r["step"] == 7:
            r["metrics"][K.WEIGHTS_MAX_LAG] = 1.0
    assert "engine_shift" not in findings(edited(tmp_path, RUNS[0], lag))


def test_silent_without_versions(tmp_path):
    """No weights lag logged: nothing says the versions agree."""
    def drop(r):
        r["metrics"].pop(K.WEIGHTS_MAX_LAG, None)
    assert "engine_shift" not in findings(edited(tmp_path, RUNS[0], drop))


def test_silent_on_one_step(tmp_path):
    """The run ends at the first shifted step (a halt): one step off is a spike, not a changed engine."""
    run_dir = edited(tmp_path, RUNS[0], lambda r: None)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if json.loads(line)["step"] != 7))
    assert "engine_shift" not in findings(run_dir)


def test_silent_when_the_level_falls_back(tmp_path):
    """Step 7 back under SHIFT x the clean level: no lasting change."""
    def back(r):
        if r["step"] == 7:
            r["metrics"][K.ABS_DIFF_CLIPPED_MEAN] = 0.9 * SHIFT * 0.009
    assert "engine_shift" not in findings(edited(tmp_path, RUNS[0], back))


def test_silent_on_a_few_sequences(tmp_path):
    """The median token at the floor while the mean rose: a few far-off sequences (their own rules)."""
    def sparse(r):
        if r["step"] >= 6:
            r["metrics"][K.ABS_DIFF_P50] = 0.003
    assert "engine_shift" not in findings(edited(tmp_path, RUNS[0], sparse))


def test_silent_without_clean_steps_before(tmp_path):
    """The level high from the run's first steps: no clean level to shift from."""
    def high(r):
        if r["step"] in (1, 2, 4, 5):
            r["metrics"][K.ABS_DIFF_CLIPPED_MEAN] = 0.1
    assert "engine_shift" not in findings(edited(tmp_path, RUNS[0], high))


def test_a_precision_switched_mid_run_stays_numeric_noise():
    """rlcheck's own loop with `bf16-noise=1@12` (tests/integration/test_faults_loop.py, recorded: an exact
    fp32 engine at 0 nats, from step 12 on a bf16 engine's 0.014): a shift no larger than a bf16 engine's
    noise is numeric noise first, the engine shift only under it."""
    result = diagnose(RECORDED.parent / "loop_runs" / "bf16-noise-at-12")
    assert [f.cause for f in result.findings] == ["numeric_noise", "engine_shift"]
    assert result.findings[1].confidence < result.findings[0].confidence
