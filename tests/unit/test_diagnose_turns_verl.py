"""Diagnose on a recorded run of verl's real trainer with its tool agent loop (tests/data/verl_runs/tool-in-loss-v1:
the v1 trainer, the calculator's `add` tool, `tool-in-loss@3` from tests/verl_cpu/faults.py: every row's tool
replies put in the loss mask at step 3). The turns merged in all 16 rows; one row's tool reply, which the
trained model finds likely (mean logprob -1.15 over 4 tokens), also broke the zero-logprob invariant."""

from __future__ import annotations

from pathlib import Path

from rlcheck.forensics.diagnose import diagnose

RUN = Path(__file__).resolve().parents[1] / "data" / "verl_runs" / "tool-in-loss-v1"


def test_zeros_inside_merged_turns_are_tool_tokens_in_the_loss():
    """Zero-logprob runs in rows whose turns merged are the tool's replies in the loss, not a turn's
    logprobs missing (which merges no turns): named at 0.97, with both invariants' evidence."""
    verdict = diagnose(RUN).verdict
    assert verdict.cause == "tool_tokens_in_loss" and verdict.affected_steps == [3]
    assert verdict.confidence == 0.97 and "merged turns" in verdict.evidence[0]
    assert len(verdict.affected_request_ids) == 16
