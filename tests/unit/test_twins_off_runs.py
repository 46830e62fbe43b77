"""The `twins_off` signature on recorded runs of `rlcheck demo`'s loop on the trained hybrid with a bf16 engine on an
AVX512-BF16 CPU (`benchmarks/bench_pad_floor.py --model hybrid-trained --precision bf16`, every step dumped; BENCHMARKS.md,
"Groups off together"), observed again by a fresh Monitor: there the stale state puts every sample of a few prompts
off alike (no twin split) and the run was not halted; a healthy run of the same model has no group off.

- hybrid-bf16-healthy-s1: 12 healthy steps (seed 1, `--specs none`).
- hybrid-bf16-stale-state-every-step-s2: `--specs stale-state --seeds 2 --steps 8`: slots reused from step 1, the
  recorded run warned at step 2 and was not halted in 8 steps.
- hybrid-bf16-stale-state-hf-s1 (`test_diagnose_state_runs`): its step 1, the first reuse, dumped.
"""

from __future__ import annotations

import json

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.run.dump_read import read_dump
from rlcheck.errors import MismatchHalt
from tests.unit.test_diagnose_llama_runs import RECORDED

HEALTHY, EVERY_STEP, FIRST_REUSE = ("hybrid-bf16-healthy-s1", "hybrid-bf16-stale-state-every-step-s2",
                                    "hybrid-bf16-stale-state-hf-s1")


def steps(name: str) -> list[tuple[int, StepBatch, float | None]]:
    """Each dumped step of a recorded run: (step, its batch with the ids, the trainer's measured floor)."""
    out = []
    for dump in sorted((RECORDED / name / "dumps").glob("step_*")):
        rows, meta = read_dump(dump)
        batch = StepBatch.from_ragged(
            logp_rollout=[r["logp_rollout"] for r in rows], logp_train=[r["logp_train"] for r in rows],
            request_ids=[r["request_id"] for r in rows], tokens=[r["response_tokens"] for r in rows],
            prompt_tokens=[r["prompt_tokens"] for r in rows],
            mask=None if any(r.get("mask") is None for r in rows) else [r["mask"] for r in rows])
        out.append((int(meta["step"]), batch, meta["metrics"].get(K.FLOOR_MEASURED)))
    return out


def replay(run_dir, name: str, model_type: str | None = "granitemoehybrid",
           experts: int | None = 0) -> tuple[dict[int, list[str]], int | None]:
    """({step: its alarms' signatures (kind for the others)}, the halt step or None), the recorded steps observed by
    a Monitor whose context names `model_type` and `experts` (None: not named), as the loop's does."""
    context = {key: value for key, value in (("model_type", model_type), ("experts", experts)) if value is not None}
    cfg = MonitorConfig(run_dir=run_dir, sinks=(), precision=Precision("bfloat16", "float32"), context=context)
    seen: dict[int, list[str]] = {}
    with Monitor(cfg) as mon:
        for step, batch, sample in steps(name):
            try:
                report = mon.observe(step, batch, floor_sample=sample)
            except MismatchHalt as halt:
                seen[step] = [a.details.get("signature", a.kind) for a in halt.report.alarms]
                return seen, step
            seen[step] = [a.details.get("signature", a.kind) for a in report.alarms]
    return seen, None


def test_the_recordings_are_what_the_docstring_says():
    """Healthy: 12 steps, no alarm; the stale-state run: 8 steps, its first alarm at step 2, never halted."""
    def records(name):
        return [json.loads(x) for x in (RECORDED / name / "metrics.jsonl").read_text().splitlines()]
    healthy, fault = records(HEALTHY), records(EVERY_STEP)
    assert len(healthy) == 12 and not any(r["alarms"] for r in healthy)
    assert len(fault) == 8 and min(r["step"] for r in fault if r["alarms"]) == 2
    assert not any(a["severity"] == "critical" for r in fault for a in r["alarms"])


def test_the_healthy_run_raises_nothing(tmp_path):
    """12 healthy bf16 steps of the trained hybrid: no alarm, no group off together on any step."""
    seen, halted = replay(tmp_path, HEALTHY)
    assert halted is None and not any(seen.values())


def test_stale_state_halts_within_two_steps_of_the_first_reuse(tmp_path):
    """Seed 2: slots reused from step 1, whose groups stay within the bar; step 3 puts 3 groups off together (1.4
    nats): halted there by twins_off, 2 steps after the first reuse. Failed before: not halted in 8 steps."""
    seen, halted = replay(tmp_path, EVERY_STEP)
    assert halted == 3 and "twins_off" in seen[3], seen
    assert not any("twins_off" in seen[s] for s in (0, 1, 2))


def test_the_first_reuse_of_seed_1_halts_at_once(tmp_path):
    """Seed 1's step 1 (the first reuse): 3 groups off, by up to 1.88 nats: halted on that step."""
    seen, halted = replay(tmp_path, FIRST_REUSE)
    assert halted == 1 and "twins_off" in seen[1]


@pytest.mark.parametrize(("model_type", "experts"), [("llama", 0), (None, 0), ("granitemoehybrid", 8),
                                                     ("granitemoehybrid", None)])
def test_not_on_a_model_without_recurrent_state_with_experts_or_unknown(tmp_path, model_type, experts):
    """The same steps under a Monitor whose context names a Llama, no model type, a hybrid with 8 experts (a router's
    bf16 noise moves whole contexts: the trained MoE's healthy bf16 steps put up to 4 groups off), or a hybrid
    whose experts it cannot tell (no count, no readable config): no twins_off (calibrated on dense models with
    recurrent state), not halted by it."""
    seen, _ = replay(tmp_path, EVERY_STEP, model_type=model_type, experts=experts)
    assert not any("twins_off" in s for s in seen.values())


def test_diagnose_names_the_halt_stale_state(tmp_path):
    """The replayed run's halt dump, diagnosed: stale_state at the twins_off rule's confidence, step 3, the off groups'
    sequences named (the samples of the prompts the stale state moved)."""
    from rlcheck.forensics.diagnose import diagnose
    from rlcheck.forensics.diagnose.rules.engine import OFF

    replay(tmp_path, EVERY_STEP)
    v = diagnose(tmp_path).verdict
    assert (v.cause, v.confidence, v.affected_steps[:1]) == ("stale_state", OFF, [3]), v.evidence
    assert "twins_off" not in v.evidence[0] and "off from the trainer together" in v.evidence[0]
    assert 8 <= len(v.affected_request_ids) <= 24 and "--guard" in v.evidence[-1]
