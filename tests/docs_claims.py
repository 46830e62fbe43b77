"""Every claim in docs/ about a fault's halt step or the cause diagnose names, and the tests that check it
on the setting it names (`tests/unit/test_docs_claims.py` holds the docs to this list: a claim line no
entry covers fails, as does an entry whose text left its page or whose test does not exist).

Each entry: (page, text the claim's line holds, test node ids). The faults.md table's rows are matched
by their SPEC cell; the other pages by a phrase of the claim."""

from __future__ import annotations

FL = "tests/integration/test_faults_loop.py::"
FIL = "tests/integration/test_faults_inputs_loop.py::"
SFD = "tests/integration/test_state_faults_demo.py::"
NAMED = FL + "TestFaultsInTheLoop::test_fault_is_caught_and_named"
SYNC = FL + "TestSyncCheckInTheLoop::test_halts_at_the_first_spoiled_step_naming_the_layers"
SETTINGS = FIL + "TestEngineSettingFaultsNamed::"
INPUTS = FIL + "TestNewFaultsInTheLoop::"
STALE = SFD + "TestStateFaultsOnTheDemosModel::test_stale_state_halts_at_the_first_reuse_named_stale_state"
WRAP = SFD + "TestStateFaultsOnTheDemosModel::test_index_wrap_halts_at_step_0_named_index_aliasing"
SKIP = SETTINGS + "test_skip_sync_every_is_weights_out_of_sync"
GUARD = "tests/integration/test_guard_loop.py::TestGuardInTheLoop::"
GUARD_CAUSES = "tests/unit/test_diagnose_engine.py::TestGuardCauses::test_each_invariant_names_its_cause"

CLAIMS: list[tuple[str, str, tuple[str, ...]]] = [
    # docs/faults.md: the "diagnose names" column, row by row
    ("docs/faults.md", "| `skip-sync-every=K` |", (SKIP,)),
    ("docs/faults.md", "| `stale-weights@S` |", (NAMED,)),
    ("docs/faults.md", "| `temperature-mismatch=F` |", (NAMED,)),
    ("docs/faults.md", "| `top-p=P` |", (SETTINGS + "test_logit_processing",)),
    ("docs/faults.md", "| `off-by-one@S` |", (NAMED,)),
    ("docs/faults.md", "and a loop's; what each leaves and the cause diagnose names:",
     ("tests/unit/test_faults_turns.py::TestDiagnose::test_names_the_cause_with_per_call_prompts",
      "tests/unit/test_faults_turns.py::TestDiagnose::test_names_the_cause_from_mask_runs")),
    ("docs/faults.md", "| `off-by-one-early@S` |", ("tests/unit/test_diagnose.py::TestDiagnose::test_off_by_one_is_token_misalignment",)),
    ("docs/faults.md", "| `bf16-noise=X@S` |", (NAMED,)),
    ("docs/faults.md", "| `corrupt-seqs=R@S` |", (NAMED,)),
    ("docs/faults.md", "| `stale-state` |", (STALE, "tests/unit/test_diagnose_state_runs.py::test_padded_rows_after_a_clean_first_step_are_stale_state",
                                              "tests/unit/test_twins_off_runs.py::test_stale_state_halts_within_two_steps_of_the_first_reuse",
                                              "tests/unit/test_twins_off_runs.py::test_the_first_reuse_of_seed_1_halts_at_once")),
    ("docs/faults.md", "| `index-wrap=B` |", (WRAP,)),
    ("docs/faults.md", "| `perturb-layer=K` |", (FL + "TestSyncCheckInTheLoop::test_an_engine_loaded_wrong_halts_before_any_sync",
                                                  "tests/integration/test_localize.py::TestStressDumps::test_perturb_layer_names_the_attention_layer")),
    ("docs/faults.md", "| `drop-sync=PATTERN@S` |", (SYNC,)),
    ("docs/faults.md", "| `permute-sync=PATTERN@S` |", (SYNC,)),
    ("docs/faults.md", "| `stale-buffer` |", (SYNC,)),
    ("docs/faults.md", "| `retokenize@S` |", (INPUTS + "test_retokenized_responses",
                                                 "tests/unit/test_diagnose_llama_runs.py::test_retokenization_that_moves_the_ids_by_one")),
    ("docs/faults.md", "| `double-bos@S` |", (INPUTS + "test_double_bos_halts_on_the_prompt_ids",)),
    ("docs/faults.md", "| `left-pad-positions@S` |", (INPUTS + "test_left_padding_without_positions",)),
    ("docs/faults.md", "| `stop-token@S` |", (SFD + "test_stop_token_on_a_model_that_stops",)),
    ("docs/faults.md", "precision noise while diagnose's healthy verdict names the floor it judged at",
     (SFD + "test_left_padding_is_never_a_bare_healthy",)),
    ("docs/faults.md", "| `stale-prefix-cache@S` |", (INPUTS + "test_stale_prefix_cache",)),
    ("docs/faults.md", "which warns past 2x, and diagnose names `stale_prefix_cache` from the prefix rows",
     ("tests/unit/test_excess_runs.py::test_a_stale_prefix_over_the_measure_warns",
      "tests/unit/test_excess_runs.py::test_diagnose_names_the_stale_prefix_the_excess_caught")),
    ("docs/faults.md", "| `rope-mismatch=F` |", (SETTINGS + "test_rope_mismatch_is_position_dependent",
                                                   "tests/unit/test_diagnose_configured.py::test_rope_base_from_the_preflight")),
    ("docs/faults.md", "| `raw-logprobs` |", (SETTINGS + "test_logit_processing",)),
    ("docs/faults.md", "| SPEC | what goes wrong | shape | diagnose names |", (NAMED,)),
    # the demo's console for a sync left out every 4th update (the weights version check halts the first stale step)
    # the halt-to-report walk-through (`rlcheck demo --inject stale-state --trainer hf`: STALE's hf fp32 cell)
    ("docs/forensics/halt-to-report.md", "halted after 2 steps: signature alarm on rlcheck/sig/twin_split", (STALE,)),
    ("docs/forensics/halt-to-report.md", "the first whose requests start in slots that step 0's held, and the run halts there",
     (STALE,)),
    ("docs/forensics/halt-to-report.md",
     "diagnose: stale recurrent state (Mamba slot reused, decode before prefill) (confidence 0.93)", (STALE,)),
    ("docs/forensics/halt-to-report.md",
     "likely cause: stale recurrent state (Mamba slot reused, decode before prefill) (confidence 0.93)", (STALE,)),
    ("docs/forensics/halt-to-report.md", "the engine turned inconsistent at step 1", (STALE,)),
    ("docs/forensics/halt-to-report.md", "reproduced: reproduced 3 of 3; shrunk from 64 batch request(s)",
     ("tests/integration/test_repro.py::TestFromTheDemo::test_engine_fault_is_reproduced_and_shrunk",)),
    ("docs/forensics/halt-to-report.md", "first wave (never-used slots): 0 of 8 fail",
     ("tests/integration/test_stress.py::TestSweepShapes::test_stale_state_spares_the_first_wave_and_grows_with_less_memory",)),
    # the second bug from the demo
    ("docs/forensics/halt-to-report.md", "32-bit offset would): the demo halts at step 0", (WRAP,)),
    ("docs/halting.md", "halted after 5 steps", (SKIP,)),
    ("docs/halting.md", "diagnose: weights not synced, or synced late (confidence 0.99)", (SKIP,)),
    ("docs/quickstart.md", "halted after 5 steps", (SKIP,)),
    ("docs/quickstart.md", "diagnose: weights not synced, or synced late (confidence 0.99)", (SKIP,)),
    ("docs/quickstart.md", "diagnose: healthy: the engine and the trainer agree", ("tests/integration/test_cli.py::TestRealDemo::test_clean_demo_runs_the_loop",)),
    ("docs/quickstart.md", "detector names the period and halts the run", ("tests/integration/test_loop.py::TestGRPOLoop::test_skip_sync_halts_on_the_period",)),
    ("docs/sync-check.md", "found at step 1", (SYNC,)),
    ("docs/sync-check.md", "halted after 2 steps", (SYNC,)),
    ("docs/sync-check.md", "diagnose: weights not synced, or synced late", (SYNC,)),
    ("docs/sync-check.md", "`--inject stale-buffer` halts at step 1", (SYNC,)),
    ("docs/quarantine.md", "the trained hybrid's first splits stay under the bf16 twin bar: warned at step 1, halted by step 3",
     (STALE,)),
    ("docs/quarantine.md", "real loop's stale-state halts at step 1", (
        "tests/integration/test_quarantine_loop.py::TestQuarantineInTheLoop::test_stale_state_is_too_much_to_quarantine", STALE)),
    ("docs/forensics/guard.md", "stale-state` halts at step 1 on invariants (i) and (v)", (
        GUARD + "test_stale_state_is_named_by_the_guard", GUARD + "test_index_wrap_is_index_aliasing")),
    ("docs/forensics/guard.md", "| check | invariant | diagnose names |", (GUARD_CAUSES,)),
    ("docs/forensics/guard.md", "| `prefill_from_zero` (i) |", (GUARD + "test_stale_state_is_named_by_the_guard", GUARD_CAUSES)),
    ("docs/forensics/guard.md", "| `slot_unique` (ii) |", (GUARD + "test_index_wrap_is_index_aliasing", GUARD_CAUSES)),
    ("docs/forensics/guard.md", "| `in_pool` (iii) |", (GUARD_CAUSES,)),
    ("docs/forensics/guard.md", "| `offset_fits` (iv) |", (GUARD_CAUSES,)),
    ("docs/forensics/guard.md", "| `freed_reinit` (v) |", (GUARD + "test_stale_state_is_named_by_the_guard", GUARD_CAUSES)),
    ("docs/forensics/diagnose.md", "diagnose names `stale_state` when the", (
        "tests/unit/test_stress.py::TestDiagnoseStressDump::test_stale_state",
        "tests/integration/test_stress.py::TestCLI::test_json_exit_code_and_diagnose")),
    ("docs/forensics/localize.md", "found at step 0: ... decoder layers [2]", (
        FL + "TestSyncCheckInTheLoop::test_an_engine_loaded_wrong_halts_before_any_sync",)),
    ("docs/integrations/verl.md", "| legacy, lr 1e-4 | 1, 2 / 3 |", (
        "tests/integration/test_verl_agent_loop.py::TestToolAgentLoop::test_diagnose_names_tool_tokens_in_the_loss",
        "tests/unit/test_faults_turns.py::TestDiagnose::test_names_the_cause_from_mask_runs")),
    ("docs/integrations/trl.md", "halts at step 1 naming all four", (
        "tests/integration/test_trl.py::TestAttachMonitor::test_a_sync_that_permuted_rows_halts_naming_the_layers",)),
    ("docs/detectors.md", "The MoE's healthy runs raise nothing in 12 steps", (
        "tests/unit/test_measured_floor.py::test_healthy_at_its_measured_floor",
        "tests/unit/test_measured_floor.py::test_diagnose_reads_the_measured_floor")),
    ("docs/detectors.md", "every token alarms at once, at the noisiest step too", (
        "tests/unit/test_measured_floor.py::test_a_fault_above_the_measured_floor_still_alarms",)),
    ("docs/forensics/diagnose.md", "on a model with recurrent state from a step after a clean first step, `stale_state` instead", (
        "tests/unit/test_diagnose_state_runs.py::test_padded_rows_with_other_token_ids_are_the_ids",
        "tests/unit/test_diagnose_state_runs.py::test_far_off_rows_beside_split_twins_from_the_first_step_are_weighed_by_the_twins",
        "tests/unit/test_diagnose_state_runs.py::test_one_prompts_padded_rows_under_a_logit_setting_are_the_setting",
        "tests/unit/test_diagnose_state_runs.py::test_padded_rows_after_a_clean_first_step_are_stale_state",
        "tests/unit/test_diagnose_state_runs.py::test_padding_from_the_first_step_or_without_state_is_padding")),
    ("docs/detectors.md", "| `twins_off` |", (
        "tests/unit/test_twins.py::TestTwinsOff::test_critical_on_a_recurrent_model_only",
        "tests/unit/test_twins.py::TestTwinsOff::test_a_fault_on_every_prompt_or_an_moe_batch_is_not_off",
        "tests/unit/test_twins_off_runs.py::test_stale_state_halts_within_two_steps_of_the_first_reuse",
        "tests/unit/test_twins_off_runs.py::test_the_healthy_run_raises_nothing",
        "tests/unit/test_twins_off_runs.py::test_diagnose_names_the_halt_stale_state")),
    ("docs/forensics/diagnose.md", "A run with no alarm is named too, at 0.6, never healthy", (
        "tests/unit/test_diagnose_configured.py::test_only_what_makes_the_sides_differ",
        "tests/unit/test_diagnose_configured.py::test_a_run_that_never_dumped_names_its_setting")),
]

PATTERNS = (r"halt(s|ed)? (at|within) step \d+", r"halted after \d+ steps?", r"found at step \d+",
            r"diagnose(:| names)", r"halts? at the first")
"""A docs line matching one of these claims a halt step or a name; it must hold some entry's text."""
TABLE_HEADERS = ("diagnose names |",)
"""A table whose header holds this claims a name on each of its rows."""
