"""The faults of issue 28 in the real loop (vLLM rollout actor, Ray, the hf trainer) on one tiny random
Llama for the module: what the trainer scores (double-bos, retokenize, left-pad-positions) and a prefix
cache the syncs do not reset (stale-prefix-cache). Each run alarms on the first step the fault acts,
keeps its evidence in a dump, and `diagnose` names the cause and only requests the fault touched."""

from __future__ import annotations

import pytest

from rlcheck.core.detect import DetectorsConfig, RobustZConfig
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
from rlcheck.core.run.dump import read_dump
from rlcheck.forensics.diagnose import diagnose
from rlcheck.forensics.diagnose.queries import MAX_IDS
from tests.loop_runs import alarm_steps, run_fault

ONSET = 4
DETECTORS = DetectorsConfig(robust_z=RobustZConfig(warmup=ONSET))


@pytest.fixture(scope="module")
def llama(tiny_model):
    """The module's model: the tiny random Llama (attention only: vLLM's CPU prefix cache takes it)."""
    return tiny_model("llama")


def _run(model, tmp_path, spec: str, steps: int):
    fault, result, touched = run_fault(model, tmp_path, spec, steps, DETECTORS)
    return fault, result, touched, alarm_steps(result)


def _dump(tmp_path, step):
    return read_dump(tmp_path / "dumps" / f"step_{step:06d}")


@pytest.mark.slow
@pytest.mark.timeout(900)
class TestNewFaultsInTheLoop:
    def test_double_bos_halts_on_the_prompt_ids(self, llama, ray_local, tmp_path):
        """The trainer's prompts carry BOS twice: a critical prompt-id alarm halts step 0, the dump holds both
        sides' prompt ids, and diagnose names prompt_mismatch for every request."""
        _, result, touched, alarms = _run(llama, tmp_path, "double-bos", 3)
        assert result.halted and result.steps_run == 1 and alarms == [0]
        assert any(a.details.get("signature") == "prompt_id_mismatch" and a.severity == "critical"
                   for a in result.reports[0].alarms)
        rows, _ = _dump(tmp_path, 0)
        assert all(list(r[PROMPT_TOKENS_TRAIN]) == [r["prompt_tokens"][0], *r["prompt_tokens"]] for r in rows)
        v = diagnose(tmp_path).verdict
        assert v.cause == "prompt_mismatch" and "BOS" in v.evidence[0], v.evidence
        assert len(touched[0]) == 64 and set(v.affected_request_ids) <= touched[0]
        assert len(v.affected_request_ids) == MAX_IDS  # a finding names at most MAX_IDS requests

    def test_retokenized_responses(self, llama, ray_local, tmp_path):
        """The random model's samples do not all round-trip through their text: the trainer's ids differ on
        some sequences from a mid-sequence token, the token-id alarm halts step 0, diagnose names
        retokenization and only sequences whose ids the fault changed."""
        _, result, touched, alarms = _run(llama, tmp_path, "retokenize", 3)
        assert result.halted and alarms == [0] and 0 < len(touched[0]) <= 64
        v = diagnose(tmp_path).verdict
        assert v.cause == "retokenization", v.evidence
        assert v.affected_request_ids and set(v.affected_request_ids) <= touched[0]

    def test_left_padding_without_positions(self, llama, ray_local, tmp_path):
        """From ONSET the trainer attends to left padding: the padded rows are off at ONSET (the first alarm),
        the longest prompts' rows are not, and diagnose names position_ids and padded rows only."""
        _, result, touched, alarms = _run(llama, tmp_path, f"left-pad-positions@{ONSET}", ONSET + 2)
        assert alarms and alarms[0] == ONSET and not any(touched[s] for s in range(ONSET))
        v = diagnose(tmp_path).verdict
        assert v.cause == "position_ids", v.evidence
        assert set(v.affected_request_ids) <= set().union(*touched.values())

    def test_stale_prefix_cache(self, llama, ray_local, tmp_path):
        """The syncs keep vLLM's prefix cache from ONSET on; prompts 0, 2, ... share a 320-token system
        prompt. Clean before ONSET, then alarms with no weights alarm; diagnose names stale_prefix_cache and
        only requests whose prompt carries the shared prefix."""
        _, result, _, alarms = _run(llama, tmp_path, f"stale-prefix-cache@{ONSET}", ONSET + 3)
        assert alarms and alarms[0] >= ONSET
        assert not any(a.kind == "weights" for r in result.reports for a in r.alarms)
        v = diagnose(tmp_path).verdict
        assert v.cause == "stale_prefix_cache", v.evidence
        rows, _ = _dump(tmp_path, v.affected_steps[0])
        long = {r["request_id"] for r in rows if len(r["prompt_tokens"]) > 300}
        assert v.affected_request_ids and set(v.affected_request_ids) <= long


@pytest.mark.slow
@pytest.mark.timeout(900)
class TestEngineSettingFaultsNamed:
    """The faults of docs/faults.md whose "diagnose names" no other loop test checked: each on the module's
    random Llama (the setting the page names for rope-mismatch), fp32 on both sides."""

    def test_rope_mismatch_is_position_dependent(self, llama, ray_local, tmp_path):
        """RoPE base x 4 in the engine: 10^3-10^4 x the fp32 floor from step 0 (a warning at once, no longer a
        wait for the sync check's probe), and diagnose names position_dependent. The loop's preflight sees the
        engine's hf_overrides (a rope_theta error in the warning at start and in the dump's context) and the
        verdict's evidence cites it where the position shape alone ranks lower."""
        with pytest.warns(RuntimeWarning, match=r"(?s)rlcheck preflight \(rlcheck's loop.*rope_theta"):
            _, result, touched, alarms = _run(llama, tmp_path, "rope-mismatch=4", 2)
        assert alarms and alarms[0] == 0 and len(touched[0]) == 64
        _, meta = _dump(tmp_path, alarms[0])
        assert [(f["key"], f["severity"]) for f in meta["context"]["preflight"]] == [("rope_theta", "error")]
        d = diagnose(tmp_path)
        assert d.verdict.cause == "position_dependent", d.verdict.evidence
        assert any("rope_theta differing" in f.evidence[0] for f in d.findings if f.cause == "position_dependent")

    @pytest.mark.parametrize("spec", ["raw-logprobs", "top-p=0.9"])
    def test_logit_processing(self, llama, ray_local, tmp_path, spec):
        """The engine's logprobs before the temperature, or its top-p nucleus: alarmed at step 0, logit_processing."""
        _, result, touched, alarms = _run(llama, tmp_path, spec, 2)
        assert alarms and alarms[0] == 0 and touched[0]
        v = diagnose(tmp_path).verdict
        assert v.cause == "logit_processing", v.evidence

    def test_skip_sync_every_is_weights_out_of_sync(self, llama, ray_local, tmp_path):
        """The sync after every 4th update left out: step 4's rollouts carry weights one version behind, a
        critical weights alarm halts there, diagnose names weights_out_of_sync."""
        _, result, touched, alarms = _run(llama, tmp_path, "skip-sync-every=4", 6)
        assert result.halted and result.steps_run == 5 and alarms == [4] and touched[4]
        v = diagnose(tmp_path).verdict
        assert v.cause == "weights_out_of_sync" and v.confidence == 0.99, v.evidence
