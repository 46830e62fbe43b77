"""Diagnose's engine-state rule (`rlcheck.forensics.diagnose.rules.engine`) on runs the real Monitor
wrote: split twins after clean steps are stale state, halted at the first split step; split from the
first step is index aliasing with the command that tells the two apart; garbage from the first step
with the weights verified is an engine-state verdict too, at both precision pairs."""

from __future__ import annotations

import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import MismatchHalt
from rlcheck.forensics.diagnose import diagnose
from rlcheck.synthetic.groups import grpo_batch

PAIRS = {"fp32": Precision("float32", "float32"), "bf16": Precision("bfloat16", "float32")}
STALE = {1, 9, 17, 26}


def record(tmp_path, batches, precision, extra=None, context=None) -> int | None:
    """Observe `batches` (step by step) until a halt; the halting step, or None. The loop's first
    alarmed step without a halt keeps its dump, as `keep_first_alarm` does."""
    with Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), precision=precision, context=context or {})) as mon:
        for step, batch in enumerate(batches):
            try:
                report = mon.observe(step, batch, extra=extra)
            except MismatchHalt:
                return step
            if report.alarms and not list(tmp_path.glob("dumps/step_*")):
                mon.dump(step, batch, report, reason="first alarm")
    return None


@pytest.mark.parametrize("pair", sorted(PAIRS))
class TestEngineState:
    def test_split_after_clean_steps_is_stale_state(self, tmp_path, pair):
        """Steps 0-1 score their twins alike, step 2 splits them: halted at step 2, `stale_state`, the
        requests of the split groups named, the guard and `rlcheck stress` pointed at."""
        noise = 1e-7 if pair == "fp32" else 3e-3
        batches = [grpo_batch(seed=s, noise=noise) for s in range(2)] + [grpo_batch(seed=2, stale=STALE, noise=noise)]
        assert record(tmp_path, batches, PAIRS[pair]) == 2
        v = diagnose(tmp_path).verdict
        assert (v.cause, v.affected_steps) == ("stale_state", [2]) and v.confidence > 0.9
        assert set(v.affected_request_ids) == {f"r{i}" for i in STALE}  # the twins the engine scored off
        assert "--guard" in " ".join(v.evidence) and "rlcheck stress" in " ".join(v.evidence)

    def test_split_from_the_first_step_is_index_aliasing(self, tmp_path, pair):
        """Twins split on the run's first step (no slot had a previous holder yet) on half the sequences:
        `index_aliasing`, saying what tells it from stale state; on a few of them (4 of 32), stale_state at 0.8
        (an engine that served before this run), with the same pointer."""
        many = set(range(0, 32, 2))
        assert record(tmp_path / "many", [grpo_batch(stale=many)], PAIRS[pair]) == 0
        v = diagnose(tmp_path / "many").verdict
        assert v.cause == "index_aliasing" and "--guard" in " ".join(v.evidence), v.evidence
        assert record(tmp_path / "few", [grpo_batch(stale=STALE)], PAIRS[pair]) == 0
        v = diagnose(tmp_path / "few").verdict
        assert (v.cause, v.confidence) == ("stale_state", 0.8) and "aliased index" in " ".join(v.evidence), v.evidence

    def test_garbage_from_the_first_step_with_the_weights_in(self, tmp_path, pair):
        """Every sequence far off at step 0 while the sync check's fingerprints agree: an engine-state
        verdict (index aliasing) with the command that tells, never "no known shape"; without the sync
        check's word it is not claimed."""
        b = grpo_batch(length=12)  # the engine sure of its samples, the trainer finding them ~6 nats less likely
        garbage = StepBatch.from_packed(b.logp_rollout, b.logp_rollout - 6.0, b.cu_seqlens, b.request_ids)
        assert record(tmp_path / "a", [garbage], PAIRS[pair], extra={"sync/fingerprint_differs": 0.0}) == 0
        v = diagnose(tmp_path / "a").verdict
        assert v.cause == "index_aliasing" and "rlcheck stress" in " ".join(v.evidence)
        assert record(tmp_path / "b", [garbage], PAIRS[pair]) == 0
        assert diagnose(tmp_path / "b").verdict.cause != "index_aliasing"
        sloped = StepBatch.from_packed(b.logp_rollout, 3.0 * b.logp_rollout - 6.0, b.cu_seqlens, b.request_ids)
        assert record(tmp_path / "c", [sloped], PAIRS[pair], extra={"sync/fingerprint_differs": 0.0}) == 0
        assert diagnose(tmp_path / "c").verdict.cause == "index_aliasing"  # a slope over garbage is no temperature

    def test_a_healthy_run_is_healthy(self, tmp_path, pair):
        """Twins alike on every step: no alarm, healthy."""
        noise = 1e-7 if pair == "fp32" else 3e-3
        assert record(tmp_path, [grpo_batch(seed=s, noise=noise) for s in range(3)], PAIRS[pair]) is None
        assert diagnose(tmp_path).verdict.cause == "healthy"


class TestProbeOnly:
    def test_a_failed_probe_with_sequences_off_from_their_first_token_is_the_engines_state(self, tmp_path):
        """The sync check's probe fails while every fingerprint agrees, on a run whose alarmed step has a part
        of its sequences diverging from their first token (a whole prompt's samples alike: no twin split):
        stale_state after a clean first step, above the weights rule's probe-only 0.85."""
        from rlcheck.core.types import Alarm

        probe = Alarm("weights", "rlcheck/weights/sync_check", 1, "critical", "the probe failed, the fingerprints agree",
                      {"differing": [], "layers": [], "probe": {"mean_abs": 0.05}})
        off = grpo_batch(seed=1, trainer_stale=set(range(8)), offset=0.6)  # prompt 0's 8 samples, first 2 tokens
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), precision=PAIRS["fp32"])) as mon:
            mon.observe(0, grpo_batch(seed=0))
            with pytest.raises(MismatchHalt):
                mon.observe(1, off, alarms=[probe])
        result = diagnose(tmp_path)
        v = result.verdict
        assert (v.cause, v.confidence) == ("stale_state", 0.88), v.evidence
        assert "weights_out_of_sync" in [f.cause for f in result.findings[1:]]


class TestGuardCauses:
    def test_each_invariant_names_its_cause(self):
        """The engine guard's broken invariants name the causes docs/forensics/guard.md's table says."""
        from rlcheck.forensics.diagnose import GUARD_CAUSE

        assert GUARD_CAUSE == {"prefill_from_zero": "stale_state", "slot_unique": "index_aliasing", "in_pool": "index_aliasing",
                               "offset_fits": "index_aliasing", "freed_reinit": "stale_state"}


def record_as(tmp_path, batches, model_type=None, model=None, extra=None) -> int | None:
    """`record` at fp32 with the dump's context naming the model (its `model_type`, or only its path)."""
    context = {k: v for k, v in {"model_type": model_type, "model": model}.items() if v is not None}
    return record(tmp_path, batches, PAIRS["fp32"], extra, context)


class TestStatelessModel:
    """A state cause needs a state: on a model the context (or its config.json) says has no recurrent layers,
    the split-twin and garbage shapes name no state cause; on a Mamba model, and on one of unknown type, they
    still do."""

    def test_split_twins_on_an_attention_model_are_not_stale_state(self, tmp_path):
        batches = [grpo_batch(seed=s, noise=1e-7) for s in range(2)] + [grpo_batch(seed=2, stale=STALE, noise=1e-7)]
        assert record_as(tmp_path / "llama", batches, model_type="llama") == 2
        d = diagnose(tmp_path / "llama")
        assert not {f.cause for f in d.findings} & {"stale_state", "index_aliasing"}, d.findings
        v = d.verdict
        assert (v.cause, v.confidence) == ("token_misalignment", 0.6), v
        assert "no recurrent state" in " ".join(v.evidence) and set(v.affected_request_ids) == {f"r{i}" for i in STALE}
        assert record_as(tmp_path / "mamba", batches, model_type="mamba2") == 2
        v = diagnose(tmp_path / "mamba").verdict
        assert (v.cause, v.confidence) == ("stale_state", 0.93)
        assert record_as(tmp_path / "unknown", batches, model="/nonexistent/model") == 2
        assert diagnose(tmp_path / "unknown").verdict.cause == "stale_state"  # unknown type: as before

    def test_the_model_type_read_from_the_model_directory(self, tmp_path):
        """A dump whose context names only the model's path (written before `model_type` was recorded): its
        config.json says what it is."""
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "llama"}')
        assert record_as(tmp_path / "run", [grpo_batch(stale=set(range(0, 32, 2)))], model=str(model)) == 0
        assert diagnose(tmp_path / "run").verdict.cause == "token_misalignment"

    def test_garbage_on_an_attention_model_is_not_aliasing(self, tmp_path):
        b = grpo_batch(length=12)
        garbage = StepBatch.from_packed(b.logp_rollout, b.logp_rollout - 6.0, b.cu_seqlens, b.request_ids)
        extra = {"sync/fingerprint_differs": 0.0}
        assert record_as(tmp_path / "llama", [garbage], model_type="llama", extra=extra) == 0
        d = diagnose(tmp_path / "llama")
        assert not {f.cause for f in d.findings} & {"stale_state", "index_aliasing"}, d.findings
        assert record_as(tmp_path / "mamba", [garbage], model_type="granitemoehybrid", extra=extra) == 0
        assert diagnose(tmp_path / "mamba").verdict.cause == "index_aliasing"

    def test_a_failed_probe_on_an_attention_model_is_not_its_state(self, tmp_path):
        """The probe-only shape (`TestProbeOnly`) on a Llama: the weights rule speaks, no state cause."""
        from rlcheck.core.types import Alarm

        probe = Alarm("weights", "rlcheck/weights/sync_check", 1, "critical", "the probe failed, the fingerprints agree",
                      {"differing": [], "layers": [], "probe": {"mean_abs": 0.05}})
        off = grpo_batch(seed=1, trainer_stale=set(range(8)), offset=0.6)
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), precision=PAIRS["fp32"],
                                   context={"model_type": "llama"})) as mon:
            mon.observe(0, grpo_batch(seed=0))
            with pytest.raises(MismatchHalt):
                mon.observe(1, off, alarms=[probe])
        d = diagnose(tmp_path)
        assert not {f.cause for f in d.findings} & {"stale_state", "index_aliasing"}, d.findings
        assert d.verdict.cause == "weights_out_of_sync"
