"""Diagnose on recorded runs of `rlcheck demo`'s loop with the stale-state fault on the trained hybrid and a bf16
engine on an AVX512-BF16 CPU (tests/data/loop_runs, `benchmarks/bench_confusion.py --seed 1 --models
hybrid-trained --precisions bf16 --trainers hf fsdp2 --only stale-state`): at step 1, the first whose requests
reuse state slots, every sample of the two shorter prompts is off from its first token (0.17-0.64 nats a row),
alike, so no twin split, and the longest prompts' rows are clean; the step read as a trainer's left padding."""

from __future__ import annotations

import json

import pytest

from rlcheck.core import metrics as K
from rlcheck.forensics.diagnose import diagnose
from rlcheck.forensics.diagnose.rules.position import STATE_ONSET
from tests.unit.test_diagnose_llama_runs import RECORDED, edited

RUNS = ("hybrid-bf16-stale-state-hf-s1", "hybrid-bf16-stale-state-fsdp2-s1")


@pytest.mark.parametrize("name", RUNS)
def test_padded_rows_after_a_clean_first_step_are_stale_state(name):
    """On a model with recurrent state, rows off from a step after a clean first one are the state slots' first
    reuse, not the trainer's padding (which would be off from the first step that padded a prompt). Failed before:
    position_ids (0.92), on both trainers."""
    v = diagnose(RECORDED / name).verdict
    assert (v.cause, v.confidence, v.affected_steps) == ("stale_state", STATE_ONSET, [1]), v.evidence
    assert "first step was clean" in v.evidence[0] and "--guard" in v.evidence[1] and len(v.affected_request_ids) == 16


def test_padding_from_the_first_step_or_without_state_is_padding(tmp_path):
    """The same rows off from the run's first step (its record as far off as step 1's), or on a model without
    recurrent state (the context's model_type a Llama): the trainer's padding, as before."""
    def first_off(record):
        if record["step"] == 0:
            record["metrics"][K.ABS_DIFF_MEAN] = 0.05
    assert diagnose(edited(tmp_path / "a", RUNS[0], edit_record=first_off)).verdict.cause == "position_ids"

    def llama(context):
        context["model_type"] = "llama"
    assert diagnose(edited(tmp_path / "b", RUNS[0], edit_context=llama)).verdict.cause == "position_ids"


def test_the_recording_is_what_the_docstring_says():
    """Step 0 clean, step 1 off on the two 6-token prompts' 16 rows and no split twins alarm in the run."""
    from rlcheck.core.run.dump_read import read_dump

    rows, _ = read_dump(RECORDED / RUNS[0] / "dumps" / "step_000001")
    short = {len(r["prompt_tokens"]) for r in rows if (abs(r["logp_rollout"] - r["logp_train"])).mean() > 0.1}
    assert short == {6} and sum(len(r["prompt_tokens"]) == 6 for r in rows) == 16
    records = [json.loads(x) for x in (RECORDED / RUNS[0] / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["metrics"][K.ABS_DIFF_CLIPPED_MEAN] < 0.01
    assert not any(a.get("details", {}).get("signature") == "split_twins" for r in records for a in r.get("alarms", []))


def test_padded_rows_with_other_token_ids_are_the_ids():
    """`off-by-one` on the trained hybrid with a bf16 engine (tests/data/loop_runs/hybrid-bf16-off-by-one-s1,
    `bench_confusion.py --seed 1 --models hybrid-trained --precisions bf16 --trainers hf --only off-by-one`):
    the trainer scored every row's ids shifted (160 tokens, a critical token_id_mismatch), and only the shorter
    prompts' rows came out off (0.19-0.28 nats, the others 0.01): the ids set |d| there, not the padding.
    Failed before: position_ids (0.92) over token_misalignment (0.85)."""
    v = diagnose(RECORDED / "hybrid-bf16-off-by-one-s1").verdict
    assert v.cause == "token_misalignment", v.evidence
    assert "not the tokens the engine sampled" in v.evidence[0]


def test_one_prompts_padded_rows_under_a_logit_setting_are_the_setting():
    """`raw-logprobs` on the trained hybrid with a bf16 engine, seed 2 (tests/data/loop_runs/hybrid-bf16-raw-logprobs-s2):
    the engine's untempered logprobs put one 5-token prompt's 8 samples 9x off the rest, the shape of padding on a
    single prompt, while d follows logp_rollout and the preflight recorded the logprobs mode. One prompt's rows are
    weak evidence of padding: logit_processing. Failed before: position_ids (0.92)."""
    from rlcheck.forensics.diagnose.rules.position import ONE_PROMPT

    result = diagnose(RECORDED / "hybrid-bf16-raw-logprobs-s2")
    assert result.verdict.cause == "logit_processing", result.verdict.evidence
    padding = [f for f in result.findings if f.cause == "position_ids"]
    assert padding and padding[0].confidence == ONE_PROMPT and "one prompt" in padding[0].evidence[-1]


def test_far_off_rows_beside_split_twins_from_the_first_step_are_weighed_by_the_twins():
    """`index-wrap=16` on the trained hybrid with a bf16 engine, seed 3 (tests/data/loop_runs/hybrid-bf16-index-wrap-s3):
    at step 0 the engine split 9 of 23 twin groups (48 sequences) and 6 sequences are far off from their first
    tokens. No slot had a previous holder at the run's first step: the twins' rule weighs the off share (an aliased
    index). Failed before: stale_state (0.85) from the early divergences alone."""
    v = diagnose(RECORDED / "hybrid-bf16-index-wrap-s3").verdict
    assert v.cause == "index_aliasing" and v.affected_steps == [0], v.evidence
    assert "before any state slot had a previous holder" in " ".join(v.evidence) and "--guard" in v.evidence[-1]


def test_left_padding_on_a_noisy_state_model_is_padding():
    """`left-pad-positions` on the random Mamba2 with a bf16 engine, seed 1 (tests/data/loop_runs/mamba2-bf16-left-pad-s1,
    `bench_confusion.py --seed 1 --models mamba2 --precisions bf16 --trainers hf --only left-pad-positions`): the
    trainer measured the model's bf16 noise at 0.033; at step 0 one 7-token prompt's 8 rows, left-padded by one,
    sit at 0.17 (the other 56 at 0.034), two of them far off from their first token (the early-divergence
    signature), and the run halted at step 1. The padded rows stand 5x over the step's own unpadded rows, under
    10x the measured floor; a run off from its first step, every far-off row a padded one, is no stale slot.
    Failed before: stale_state (0.85)."""
    from rlcheck.forensics.diagnose.rules.engine import PADDED_FIRST
    from rlcheck.forensics.diagnose.rules.position import ONE_PROMPT

    result = diagnose(RECORDED / "mamba2-bf16-left-pad-s1")
    v = result.verdict
    assert (v.cause, v.confidence, v.affected_steps) == ("position_ids", ONE_PROMPT, [0]), v.evidence
    assert "pass position_ids" in v.evidence[1] and len(v.affected_request_ids) == 8
    state = [f for f in result.findings if f.cause == "stale_state"]
    assert state and state[0].confidence == PADDED_FIRST and "padding without position ids" in state[0].evidence[-1]


def test_far_off_padded_rows_after_clean_first_steps_stay_stale_state(tmp_path):
    """The same far-off padded rows in a run whose first step was clean and alarmed later (step 0's alarms removed,
    as a run whose stale slots are first reused at step 1 would record it): the early divergences keep their 0.85."""
    def quiet_first(record):
        if record["step"] == 0:
            record["alarms"] = []

    state = [f for f in diagnose(edited(tmp_path / "a", "mamba2-bf16-left-pad-s1", edit_record=quiet_first)).findings
             if f.cause == "stale_state"]
    assert state and state[0].confidence == 0.85
