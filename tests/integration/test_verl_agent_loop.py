"""verl's tool agent loop (`ToolAgentLoop`) inside verl's real trainer with rlcheck attached, as a user runs
it: `python -m verl.trainer.main_ppo` with the calculator's tool, parser and rows (tests/verl_cpu/calculator.py:
the tiny Llama trained on rlcheck's calculator task calls `add(a=12, b=7)`, verl runs the `add` BaseTool and
renders its reply with the chat template, mask 0), rlcheck loaded as a verl plugin. `make test-verl` (its own
venv); skipped elsewhere.

One real run of the default v1 trainer (the agent loop's turn counts are the rows' `num_turns` field in its
TransferQueue; ~2-3 minutes here, nearly all Ray and vLLM start-up): steps 1 and 2 healthy, at step 3 the
tool replies of every multi-turn row put into verl's loss mask (`tool-in-loss@3`, tests/verl_cpu/faults.py),
which rlcheck halts. The legacy trainer (`trainer.use_v1=false`: `__num_turns__` in its `DataProto`) ran the
same here (docs/integrations/verl.md, "The agent loop with a tool").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("transfer_queue", reason="verl's trainer runs in its own venv: make test-verl")
pytest.importorskip("verl")

from rlcheck.core import metrics as K  # noqa: E402
from rlcheck.forensics.diagnose import diagnose  # noqa: E402
from tests.integration.test_verl_trainer import BF16_EXP, agrees_with_verl, alarms, journal  # noqa: E402
from tests.verl_cpu import assets  # noqa: E402
from tests.verl_cpu import run as verl_run  # noqa: E402

HEALTHY = (1, 2)
FAULT_STEP = 3


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-agent")
    model = assets.calculator_model(Path("runs/models").resolve())
    train = assets.calculator_problems(root / "train.parquet", 64, 0)
    val = assets.calculator_problems(root / "val.parquet", 8, 1)
    user = root / "checkpoints"
    argv = verl_run.tool_agent_command(model, train, val, user, "agent", FAULT_STEP,
                                       "actor_rollout_ref.actor.optim.lr=1e-4")  # the policy keeps calling the tool
    result = verl_run.main_ppo(root / "out", argv, faults=f"tool-in-loss@{FAULT_STEP}")
    print(f"verl run agent: exit {result.returncode} in {result.seconds:.0f} s; log {root / 'out' / 'run.log'}")
    result.run_dir = user / "rlcheck"
    return result


def num_turns(result) -> dict[int, list[int]]:
    """verl's `__num_turns__` per row of each step, as its agent loop put them in the batch."""
    return {r["step"]: r["num_turns"] for r in result.records("batch")}


@pytest.mark.supports("verl", "agent loop", "ToolAgentLoop, a tool (v1 trainer)")
class TestToolAgentLoop:
    def test_rows_take_several_model_turns(self, agent_run):
        """verl's agent loop ran the tool: rows of the healthy steps took 2 or 3 model turns (num_turns =
        user + assistant + 1: 4 or 6), and verl logged its own num_turns metrics."""
        turns = num_turns(agent_run)
        assert sorted(turns) == [1, 2, 3], agent_run.failure()
        for step in HEALTHY:
            assert any(n >= 4 for n in turns[step]), (step, turns[step])
        logged = agent_run.verl_metrics()
        assert logged[1]["num_turns/max"] >= 4

    def test_per_turn_statistics_in_the_journal_and_verls_logger(self, agent_run):
        """rlcheck's journal holds the per-turn statistics of each healthy step, its turn count is verl's
        (the turn-count invariant holds on every row), and verl's logger has them beside its own."""
        records, turns, logged = journal(agent_run.run_dir), num_turns(agent_run), agent_run.verl_metrics()
        for step in HEALTHY:
            m = records[step]["metrics"]
            assert m[K.TURN_COUNT] == sum(n // 2 for n in turns[step]), step
            assert m[K.turn_invariant("turn_count")] == 0 and m[K.TURN_PER_SEQ_MAX] >= 2, step
            assert m[K.TURN_TOOL_TOKENS] > 0, step  # the tool's replies: mask 0, not compared
            assert m[K.turn_metric(0, "tokens")] > 0 and m[K.turn_metric(1, "tokens")] > 0, step
            assert m[K.turn_metric(1, "abs_diff_mean")] < 0.05, step
            assert logged[step][K.TURN_COUNT] == m[K.TURN_COUNT] and "num_turns/mean" in logged[step]

    def test_healthy_steps_are_quiet_and_agree_with_verl(self, agent_run):
        """Steps 1 and 2: no alarm; rlcheck's figures equal verl's own on the same multi-turn batch (the v1
        trainer's probs diff within its bfloat16 exp() of rlcheck's)."""
        records = journal(agent_run.run_dir)
        assert [alarms(records[s]) for s in HEALTHY] == [[], []]
        agrees_with_verl(agent_run, list(HEALTHY), BF16_EXP)

    def test_tool_tokens_in_loss_caught_at_its_step(self, agent_run):
        """Step 3's tool replies in verl's loss mask: the turn runs merge, the turn count breaks on exactly the
        rows the fault touched, critical: rlcheck halts verl's trainer at step 3 with the dump written."""
        (fault,) = [f for f in agent_run.records("faults") if f["fault"] == "tool-in-loss"]
        assert fault["step"] == FAULT_STEP and fault["rows"], "no multi-turn row at the fault's step"
        records = journal(agent_run.run_dir)
        assert sorted(records) == [1, 2, 3], agent_run.failure()
        (alarm,) = [a for a in records[FAULT_STEP]["alarms"] if a["metric"] == K.turn_invariant("turn_count")]
        assert alarm["severity"] == "critical"
        assert {int(e["index"]) for e in alarm["details"]["evidence"]} <= set(fault["rows"])
        assert alarm["details"]["count"] == len(fault["rows"])
        assert all(e["found"] < e["framework"] for e in alarm["details"]["evidence"])  # turns merged, none split
        assert agent_run.returncode != 0 and f"rlcheck halted the run at step {FAULT_STEP}" in agent_run.log
        assert (agent_run.run_dir / "dumps" / f"step_{FAULT_STEP:06d}" / "sequences.parquet").is_file()

    def test_diagnose_names_tool_tokens_in_the_loss(self, agent_run):
        verdict = diagnose(agent_run.run_dir).verdict
        assert verdict.cause == "tool_tokens_in_loss" and verdict.affected_steps == [FAULT_STEP]
        cli = subprocess.run([str(Path(sys.executable).with_name("rlcheck")), "diagnose", str(agent_run.run_dir)],
                             capture_output=True, text=True)
        assert cli.returncode == 1 and "tool tokens in the loss" in cli.stdout

    def test_command_recorded(self, agent_run):
        """The exact command line (docs/integrations/verl.md shows it)."""
        command = (agent_run.out / "command.txt").read_text()
        assert "multi_turn.format=calculator" in command and "calculator_tools.yaml" in command
        assert command.count("actor_rollout_ref.actor.optim.lr=") == 1
