"""Diagnose on recorded runs of `rlcheck demo`'s loop on the tiny Llamas (tests/data/loop_runs, written by
`benchmarks/bench_confusion.py` on held-out seeds, the hf trainer): a stale prefix cache under a bf16 engine,
whose prefix rows stand 4-7x over the step's other rows but under the fp32-sized bars (was "no known shape" and
"position-dependent"), and a RoPE base x 4 on the trained Llama, off on every token from the first step with no
trend in the position (was "stale recurrent state" on a model that has none). Each asserts the recorded figures
the rule reads, then the verdict; and the same records edited where the rules must stay silent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rlcheck.forensics.diagnose import diagnose

RECORDED = Path(__file__).resolve().parents[1] / "data" / "loop_runs"
STALE_PREFIX = {"llama-bf16-stale-prefix-s1": 6, "llama-calculator-bf16-stale-prefix-s2": 3}
"""Recorded run -> its dumped (first alarmed) step: the random Llama, seed 1 (prefix rows 0.094 vs 0.017, 5.4x;
the step's mean 0.055, 2.8x the first step's 0.0195) and the trained calculator Llama, seed 2 (0.105 vs 0.016,
6.6x; the mean 0.086, 4.8x the first step's)."""
ROPE = "llama-calculator-fp32-rope-s1"
"""The trained Llama with the engine's RoPE base x 4, seed 1: halted at step 1, clipped mean |d| 0.19 and 0.18,
median token 0.15 and 0.14, 16% and 5% of the sequences catastrophic, fingerprints agreeing."""


def edited(tmp_path: Path, name: str, edit_record=None, edit_context=None) -> Path:
    """A copy of recorded run `name`, its step records and its dumps' context changed in place."""
    run_dir = tmp_path / name
    shutil.copytree(RECORDED / name, run_dir)
    if edit_record is not None:
        path = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for r in records:
            edit_record(r)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    if edit_context is not None:
        for meta in run_dir.glob("dumps/*/meta.json"):
            m = json.loads(meta.read_text())
            edit_context(m["context"])
            meta.write_text(json.dumps(m))
    return run_dir


@pytest.mark.parametrize("name", sorted(STALE_PREFIX))
def test_stale_prefix_cache_under_a_bf16_engine(name):
    """The prefix rows off, the others at the first step's level, the step past the bf16 gate: named, the prefix
    rows listed; the step's mean under 5x the first step's and the rows under the fp32-sized 0.1 did not matter."""
    v = diagnose(RECORDED / name).verdict
    assert (v.cause, v.affected_steps) == ("stale_prefix_cache", [STALE_PREFIX[name]]), (v.cause, v.evidence)
    assert "-token prefix" in v.evidence[0] and "reset_prefix_cache" in v.evidence[1]


def test_stale_prefix_needs_the_rows_apart(tmp_path):
    """The same run with a weights alarm on record (the sync check found the engine's weights wrong): the prefix
    cache is not the likely cause."""
    def weights_alarm(r):
        if r["step"] == STALE_PREFIX["llama-bf16-stale-prefix-s1"]:
            r.setdefault("alarms", []).append({"kind": "weights", "key": "rlcheck/weights/sync_check", "step": r["step"],
                                               "severity": "critical", "message": "weights differ", "details": {}})
    run = edited(tmp_path, "llama-bf16-stale-prefix-s1", edit_record=weights_alarm)
    assert diagnose(run).verdict.cause != "stale_prefix_cache"


def test_rope_on_the_trained_llama_is_the_engines_computation():
    """Every token off from the first step, the fingerprints agreeing, an attention-only model: `engine_shift` from
    the first step, pointing at the config (RoPE among it) and `rlcheck localize`; no state cause."""
    result = diagnose(RECORDED / ROPE)
    v = result.verdict
    assert (v.cause, v.affected_steps) == ("engine_shift", [0, 1]), (v.cause, v.evidence)
    text = " ".join(v.evidence)
    assert "first step" in text and "RoPE" in text and "rlcheck localize" in text and "(llama)" in text
    assert not {f.cause for f in result.findings} & {"stale_state", "index_aliasing"}, result.findings


def test_rope_shape_on_a_recurrent_model_is_left_to_the_state_rules(tmp_path):
    """The same records from a Mamba model: state faults compute garbage with the right weights there, so the
    first-step engine shift does not speak (the early divergence names stale state, as it did)."""
    run = edited(tmp_path, ROPE, edit_context=lambda c: c.update(model_type="mamba2"))
    result = diagnose(run)
    assert "engine_shift" not in {f.cause for f in result.findings}
    assert result.verdict.cause == "stale_state"


def test_first_step_shift_needs_the_fingerprints(tmp_path):
    """Without the sync check's fingerprints at the first step (weights unverified) the first-step shift is not
    claimed."""
    run = edited(tmp_path, ROPE, edit_record=lambda r: r["metrics"].pop("sync/fingerprint_differs", None))
    assert "engine_shift" not in {f.cause for f in diagnose(run).findings}


def test_first_step_shift_needs_the_skew(tmp_path):
    """The same records with d symmetric (mean d 0): precision noise of that size, not an engine sampling from a
    distribution of its own; the first-step shift is not claimed."""
    run = edited(tmp_path, ROPE, edit_record=lambda r: r["metrics"].update({"rlcheck/token/diff_mean": 0.0}))
    assert "engine_shift" not in {f.cause for f in diagnose(run).findings}


NOISE = "llama-bf16-noise16-s3"
"""The random Llama, a bf16 engine with bf16-noise=16, seed 3: mean |d| 0.21-0.23 a step, mean d -0.003 to 0.006,
and one of 64 sequences far off from its first token at step 0 (an `early_divergence` signature alarm)."""


def test_noise_with_one_far_off_sequence_on_an_attention_model():
    """A steady symmetric rise with a lone far-off sequence: numeric noise on a model without recurrent state (was
    "stale recurrent state", then "no known shape" once the state causes needed a state)."""
    result = diagnose(RECORDED / NOISE)
    assert result.verdict.cause == "numeric_noise", [(f.cause, f.evidence) for f in result.findings]
    assert not {f.cause for f in result.findings} & {"stale_state", "index_aliasing"}


def test_the_lone_far_off_sequence_still_counts_on_a_recurrent_model(tmp_path):
    """The same records from a model with recurrent state (the dump's context names Mamba2): the signature is a
    state shape there, not noise."""
    run = edited(tmp_path, NOISE, edit_context=lambda c: c.update(model_type="mamba2"))
    assert diagnose(run).verdict.cause == "stale_state"


RETOKENIZED, OFF_BY_ONE = "llama-calculator-bf16-retokenize-s4", "llama-calculator-bf16-off-by-one-s4"
"""The trained calculator Llama with a bf16 engine, seed 4 (`bench_confusion.py --seed 4 --models llama-calculator
--precisions bf16 --trainers hf --only retokenize off-by-one`), halted at step 0. Every response starts with the
special token 4 that the decoded text leaves out, so re-tokenizing drops it: on 62 of 64 rows the trainer's ids are
the engine's moved by one token as an off-by-one's are, but its logprobs were computed without that token (mean |d|
7.6 aligned, 8.0 read one token over); the off-by-one's ids move the same way and its logprobs fit the move (1.2
aligned, 0.011 read over). Was `token_misalignment` for both."""


def test_retokenization_that_moves_the_ids_by_one():
    """Ids moved by one with logprobs that follow no shift: re-tokenization, the lost token named; the off-by-one
    beside it stays token_misalignment."""
    v = diagnose(RECORDED / RETOKENIZED).verdict
    assert v.cause == "retokenization", v.evidence
    assert "without the engine's id 4" in v.evidence[0] and "62 of 64" in v.evidence[0] and "follow no shift" in v.evidence[1]
    assert diagnose(RECORDED / OFF_BY_ONE).verdict.cause == "token_misalignment"


def test_retokenization_needs_logprobs_that_follow_no_shift(tmp_path):
    """The retokenized run's ids with the trainer's logprobs replaced by the engine's read one token late (as an
    off-by-one reads them): token_misalignment, as before."""
    import pandas as pd

    run = tmp_path / RETOKENIZED
    shutil.copytree(RECORDED / RETOKENIZED, run)
    seqs = run / "dumps" / "step_000000" / "sequences.parquet"
    rows = pd.read_parquet(seqs)
    rows["logp_train"] = [np.append(lr[1:], lr[-1]) for lr in rows["logp_rollout"]]
    rows.to_parquet(seqs)
    assert diagnose(run).verdict.cause == "token_misalignment"
