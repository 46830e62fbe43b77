"""Diagnose names a mismatch the run was configured to have (`rules.configured`): the static preflight the loop,
TRL and verl record in every dump's context found a setting on which the sides compute differently, and the run
alarmed. Recorded runs of `rlcheck demo`'s loop (tests/data/loop_runs): the trained Llama with the engine's RoPE
base x 4 (recorded before the loop's preflight saw the fault's hf_overrides; its context here as the loop now
records it), whose shape alone reads as an engine shift."""

from __future__ import annotations

import pytest

from rlcheck.forensics.diagnose import diagnose
from rlcheck.forensics.diagnose.evidence import load_evidence
from rlcheck.forensics.diagnose.rules.configured import (
    CAUSE_OF,
    CONFIDENCE,
    QUIET_CONFIDENCE,
    configured_difference,
)
from tests.unit.test_diagnose_llama_runs import RECORDED, ROPE, edited

ROPE_FINDING = {"key": "rope_theta", "severity": "error", "trainer": 10000.0, "engine": 40000.0,
                "message": "the RoPE base differs: every position after the first is rotated differently, so "
                           "attention scores drift apart with distance.",
                "fix": "Load the engine with the trainer's RoPE settings: the same config.json, or vLLM "
                       "hf_overrides={'rope_parameters': <the trainer's>} (transformers 5; 'rope_theta' with "
                       "transformers 4)."}
"""The finding `rlcheck.loop.preflight_wiring` records for rope-mismatch=4 on the tiny Llamas (rope_theta 1e4)."""


def with_preflight(*findings):
    def edit(context):
        context["preflight"] = list(findings)
    return edit


def test_rope_base_from_the_preflight(tmp_path):
    """The trained Llama, RoPE base x 4: without the setting on record, an engine shift (the shape: off at every
    distance, no trend in the position); with the preflight's rope_theta finding, position-dependent, the two
    values and the fix in the evidence, the shift kept as an alternative. Failed before: diagnose read no setting."""
    assert diagnose(RECORDED / ROPE).verdict.cause == "engine_shift"
    d = diagnose(edited(tmp_path, ROPE, edit_context=with_preflight(ROPE_FINDING)))
    v = d.verdict
    assert (v.cause, v.confidence) == ("position_dependent", CONFIDENCE), v.evidence
    assert "rope_theta differing: trainer 10000.0, engine 40000.0" in v.evidence[0]
    assert "hf_overrides" in v.evidence[1] and v.affected_steps == [0, 1]
    assert "engine_shift" in [f.cause for f in d.findings[1:]]


@pytest.mark.parametrize("finding, cause", [
    ({"key": "logprobs_mode", "severity": "error", "trainer": "T=0.7", "engine": "raw_logprobs (T=1)"}, "logit_processing"),
    ({"key": "rms_norm_eps", "severity": "error", "trainer": 1e-6, "engine": 1e-5}, "engine_shift"),
    ({"key": "sliding_window", "severity": "error", "trainer": None, "engine": 64}, "position_dependent"),
])
def test_each_setting_its_cause(tmp_path, finding, cause):
    """The setting's family names the cause: sampling a logit-processing mismatch, numerics an engine shift, a
    window the position."""
    v = diagnose(edited(tmp_path, ROPE, edit_context=with_preflight(finding))).verdict
    assert (v.cause, CAUSE_OF[finding["key"]]) == (cause, cause)


def test_only_what_makes_the_sides_differ(tmp_path):
    """A warning (a bf16 engine's dtype), a note (the prefix cache) or a key with no cause: the shape decides. On
    a run with no alarm the setting is still named, at QUIET_CONFIDENCE, never healthy (failed before: silent, the
    verdict healthy); without an error setting the rule stays silent."""
    quiet = [{"key": "dtype", "severity": "warn"}, {"key": "prefix_cache", "severity": "info"},
             {"key": "double_bos", "severity": "error"}]
    assert diagnose(edited(tmp_path, ROPE, edit_context=with_preflight(*quiet))).verdict.cause == "engine_shift"

    def no_alarms(record):
        record["alarms"] = []
    run = edited(tmp_path / "calm", ROPE, edit_record=no_alarms, edit_context=with_preflight(ROPE_FINDING))
    found = configured_difference(load_evidence(run))
    assert (found.cause, found.confidence, found.affected_steps) == ("position_dependent", QUIET_CONFIDENCE, [])
    assert "no alarm" in found.evidence[1] and "hf_overrides" in found.evidence[1]
    d = diagnose(run)  # its dumps' rows still read as an engine shift, ranked above the quiet setting
    assert not d.healthy and "position_dependent" in [f.cause for f in d.findings]
    calm = edited(tmp_path / "calm-quiet", ROPE, edit_record=no_alarms, edit_context=with_preflight(*quiet))
    assert configured_difference(load_evidence(calm)) is None


def test_raw_logprobs_on_the_bf16_moe():
    """The trained MoE with a bf16 engine returning raw logprobs at T=0.7 (seed 1): 3- to 4-token responses, d one-
    signed on the likely tokens but barely correlated with the engine's logprobs, read as numeric noise from the
    shape alone; the loop's preflight recorded the logprobs_mode error, and the verdict is logit processing.
    Failed before: numeric_noise (the loop's preflight did not see the fault's engine settings either)."""
    name = "moe-bf16-raw-logprobs-s1"
    d = diagnose(RECORDED / name)
    assert (d.verdict.cause, d.verdict.confidence) == ("logit_processing", CONFIDENCE), d.verdict.evidence
    assert "logprobs_mode differing: trainer T=0.7, engine raw_logprobs (T=1)" in d.verdict.evidence[0]


def test_raw_logprobs_shape_alone(tmp_path):
    """The same run without the preflight on record: the shape alone names numeric noise (why the setting matters)."""
    v = diagnose(edited(tmp_path, "moe-bf16-raw-logprobs-s1", edit_context=with_preflight())).verdict
    assert v.cause == "numeric_noise", v.evidence


def test_a_run_that_never_dumped_names_its_setting(tmp_path):
    """A run within its noise raises no alarm and writes no dump, so the dumps' context never held its preflight:
    the loop writes the context to context.json at start (`Run.write_context`), and diagnose reads it there. The
    recorded RoPE run without its alarms and dumps: the setting named, not healthy (failed before: healthy, the
    findings nowhere); without context.json, healthy."""
    import shutil

    from rlcheck.core.run.run import Run

    def no_alarms(record):
        record["alarms"] = []
    run = edited(tmp_path, ROPE, edit_record=no_alarms)
    shutil.rmtree(run / "dumps")
    assert diagnose(run).healthy
    context = {"model_type": "llama", "framework": "loop", "preflight": [ROPE_FINDING]}
    Run.open(run).write_context(context)
    assert Run.open(run).context() == context and Run.open(run).saved_context() == context
    d = diagnose(run)  # its records past the gates (the alarms taken out) read as an engine shift too
    assert not d.healthy
    assert ("position_dependent", QUIET_CONFIDENCE) in [(f.cause, f.confidence) for f in d.findings], d.findings
