"""The two Mamba state faults as a user meets them (issue 37): `rlcheck demo`'s loop and Monitor on the
demo's default model, the trained hybrid (trained for 120 steps here to keep the suite short; its
answers are 3-4 tokens long, as the demo's), without the engine guard. stale-state halts at step 1, the
first step whose requests reuse state slots (with a bf16 engine on an AVX512-BF16 CPU: warned there, halted
within 2 steps of it), and diagnose names stale_state; index-wrap halts at step
0 and diagnose names index_aliasing, saying what tells it from stale state. Each injection reports what
it touched. The demo's trainers and precisions: fsdp2 with 2 ranks on fp32 (its defaults), the hf
trainer on fp32 (docs/forensics/halt-to-report.md's run) and against a bf16 engine (`--engine-dtype
bfloat16`); every other cell: `benchmarks/bench_confusion.py`."""

from __future__ import annotations

import json

import pytest

from rlcheck.core.monitor import Monitor
from rlcheck.demo.run import DemoOptions, monitor_config
from rlcheck.forensics.diagnose import diagnose
from rlcheck.loop import run_grpo
from rlcheck.loop.presets import tiny_cpu

CELLS = [("fsdp2", 2, "float32"), ("hf", 1, "float32"), ("hf", 1, "bfloat16")]


@pytest.fixture(scope="module")
def trained_hybrid(tmp_path_factory):
    from rlcheck.modelzoo import build_trained

    return build_trained("hybrid", tmp_path_factory.mktemp("trained") / "hybrid-trained", steps=120)


def demo_run(model, run_dir, spec: str, trainer: str, world_size: int, dtype: str):
    """The demo's loop and Monitor (`rlcheck demo --inject SPEC --trainer T --world-size W --engine-dtype D
    --no-wandb`), 4 steps at most; (result, {step: touched request ids})."""
    opts = DemoOptions(run_dir=run_dir, model=model, trainer=trainer, world_size=world_size, steps=4, inject=spec,
                       wandb=False, engine_dtype=dtype)
    cfg = tiny_cpu(model, trainer=trainer, world_size=world_size, steps=4, fault=opts.fault, engine_dtype=dtype)
    with Monitor(monitor_config(opts, cfg)) as mon:
        result = run_grpo(cfg, mon)
    lines = [json.loads(x) for x in (run_dir / "loop.jsonl").read_text().splitlines()]
    return result, {x["step"]: set(x.get("fault_touched") or ()) for x in lines}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("trainer", "world_size", "dtype"), CELLS)
class TestStateFaultsOnTheDemosModel:
    def test_stale_state_halts_at_the_first_reuse_named_stale_state(self, trained_hybrid, ray_local, tmp_path,
                                                                     trainer, world_size, dtype):
        """Step 0 (never-used slots) clean and untouched; step 1 reuses slots: the engine scores the samples of a
        prompt apart (split_twins, critical), the run halts there, diagnose says stale_state. With a bf16 engine the
        CPU decides how far apart: on an AVX512-BF16 CPU (vLLM's native bf16 kernels) the previous holders' states
        put step 1's twins 0.03-0.04 nats apart, under the bf16 twin bar (0.2 (1 - p)^0.91: 0.12 there), and every
        sequence 0.1-1.8 nats off from its first token: a warning at step 1 (the clipped mean 0.075 past 0.05), the
        halt by step 3 (split twins, or a few prompts' groups off together: `twins_off`). Both paths: halted within 2 steps of the first reuse (issue 37's contract),
        alarmed at it, named stale_state. With the bf16 engine the trainer measured its own bf16 noise on every
        step's tokens (the floor the step is judged at where it is above the bf16 level: under it here, 0.002-0.008
        on the trained hybrid), with fp32 on both sides it measured nothing."""
        result, touched = demo_run(trained_hybrid, tmp_path, "stale-state", trainer, world_size, dtype)
        records = [json.loads(x)["metrics"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        measured = [r.get("rlcheck/floor/measured") for r in records]
        if dtype == "float32":
            assert measured == [None] * len(records)
        else:
            assert all(m is not None and 0.0 < m < 0.05 for m in measured), measured
            assert {r["rlcheck/floor/level"] for r in records} == {0.01}
        assert result.halted and not result.reports[0].alarms and not touched[0] and touched[1]
        halt = result.steps_run - 1
        assert halt == 1 if dtype == "float32" else (1 <= halt <= 3 and result.reports[1].alarms), halt
        state = [a for a in result.reports[-1].alarms if a.details.get("signature") in ("split_twins", "twins_off")]
        assert state and state[0].severity == "critical"
        v = diagnose(tmp_path).verdict
        assert (v.cause, v.affected_steps) == ("stale_state", [halt]), v.evidence
        assert set(v.affected_request_ids) <= touched[halt]

    def test_index_wrap_halts_at_step_0_named_index_aliasing(self, trained_hybrid, ray_local, tmp_path,
                                                              trainer, world_size, dtype):
        """64 live requests past 16 state blocks share state from step 0: halted there, index_aliasing, with the
        commands that tell it from stale state."""
        result, touched = demo_run(trained_hybrid, tmp_path, "index-wrap=16", trainer, world_size, dtype)
        assert result.halted and result.steps_run == 1 and touched[0]
        v = diagnose(tmp_path).verdict
        assert v.cause == "index_aliasing", v.evidence
        assert "--guard" in " ".join(v.evidence) and "rlcheck stress" in " ".join(v.evidence)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_left_padding_is_never_a_bare_healthy(trained_hybrid, ray_local, tmp_path):
    """left-pad-positions pads the task's one short prompt by a token: on fp32 it alarms at step 0 and diagnose names
    position_ids; with a bf16 engine its shift sits within the engine's noise (BENCHMARKS.md, "Left padding under a
    bf16 engine's noise"): named position_ids, or healthy saying it was judged at the bf16 floor and how to see
    below it, never a bare healthy."""
    result, touched = demo_run(trained_hybrid, tmp_path / "fp32", "left-pad-positions", "hf", 1, "float32")
    assert touched[0] and result.reports[0].alarms
    assert diagnose(tmp_path / "fp32").verdict.cause == "position_ids"
    result, touched = demo_run(trained_hybrid, tmp_path / "bf16", "left-pad-positions", "hf", 1, "bfloat16")
    v = diagnose(tmp_path / "bf16").verdict
    assert any(touched.values())
    assert v.cause == "position_ids" or (v.cause == "healthy" and "bfloat16 floor" in " ".join(v.evidence)), v.evidence


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stop_token_on_a_model_that_stops(trained_hybrid, ray_local, tmp_path):
    """The trained hybrid ends its answers with the stop token: stop-token touches every such sequence from
    step 0 and diagnose names stop_token (on a model that never stops it touches nothing: the demo says so)."""
    result, touched = demo_run(trained_hybrid, tmp_path, "stop-token", "hf", 1, "float32")
    assert touched[0] and result.reports[0].alarms
    v = diagnose(tmp_path).verdict
    assert v.cause == "stop_token", v.evidence
    assert set(v.affected_request_ids) <= touched[0]
