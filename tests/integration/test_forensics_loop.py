"""Forensics on a dump the real loop wrote (Ray actors, vLLM, the hf trainer): one run of the tiny hybrid
whose engine returns raw logprobs while both sides sample and score at T = 0.7, in vLLM's dtype "auto"
(bfloat16 for this float32 checkpoint on CPU), with an engine guard that cannot write its break
snapshots. Replay reads the sampling from the dump (raw: T = 1), localize judges at the dtype the engine
ran (bfloat16's tolerance), and the guard's death is an alarm in the journal."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.run.context import read_context
from rlcheck.core.run.dump import read_dump
from rlcheck.engines.guard import ALIVE_METRIC, DEAD_SIGNATURE
from rlcheck.loop import run_grpo
from rlcheck.loop.presets import tiny_cpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def loop_run(tiny_model, ray_local, tmp_path_factory):
    """(run dir, its first dump) of one loop step as the module docstring says."""
    root = tmp_path_factory.mktemp("forensics-loop")
    (root / "elsewhere" / "guard").mkdir(parents=True)
    (root / "elsewhere" / "guard" / "break").write_text("a file where the guard's snapshots would go")
    cfg = tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=1, guard=True)
    ids = tuple(str(i) for i in range(64)) + tuple(f"{i}_{p}" for i in range(8) for p in range(64))
    guard = replace(cfg.rollout.guard, run_dir=str(root / "elsewhere"), break_on=ids)
    cfg = replace(cfg, rollout=replace(cfg.rollout, dtype="auto", logprobs_mode="raw_logprobs", temperature=0.7,
                                       guard=guard), trainer=replace(cfg.trainer, temperature=0.7))
    run_dir = root / "run"
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context=cfg.context())) as mon:
        result = run_grpo(cfg, mon)
    dumps = sorted((run_dir / "dumps").glob("step_*"))
    assert result.steps_run == 1 and dumps, result.reason
    return run_dir, dumps[0]


class TestForensicsOnALoopDump:
    def test_the_dump_records_what_the_engine_ran(self, loop_run):
        """The loop's dump: raw logprobs at T = 0.7, configured "auto", ran bfloat16 (asked of the actor)."""
        _, meta = read_dump(loop_run[1])
        ctx = read_context(meta)
        assert (ctx.framework, ctx.sampling.logprobs_mode, ctx.sampling.temperature) == ("loop", "raw_logprobs", 0.7)
        assert (ctx.engine.configured_dtype, ctx.engine.dtype) == ("auto", "bfloat16")

    def test_replay_scores_raw_logprobs_untempered(self, loop_run):
        """Replay takes T = 1 from the dump (raw logprobs), and no request fails: the bf16 engine is within
        its noise of the fp32 reference. At T = 0.7, the dump's sampling temperature, most requests would."""
        from rlcheck.forensics.replay import replay

        report = replay(loop_run[1])
        assert (report.temperature, report.temperature_from) == (1.0, "dump: raw logprobs, untempered")
        assert report.records and not report.failed
        assert len(replay(loop_run[1], temperature=0.7).failed) > len(report.records) // 2

    def test_localize_judges_at_the_dtype_the_engine_ran(self, loop_run):
        """Localize re-runs in bfloat16 and judges at bfloat16's tolerance: no request diverges (at the
        float32 tolerance every one did, at layer 0)."""
        from rlcheck.forensics.localize import localize
        from rlcheck.forensics.localize.compare import TOLERANCES

        result = localize(loop_run[1], top=2, write=False)
        assert (result.dtype, result.tolerance) == ("bfloat16", TOLERANCES["bfloat16"])
        assert len(result.requests) == 2 and not result.divergent
        worst = max(layer.max_rel_err for r in result.requests for layer in r.layers)
        assert TOLERANCES["float32"] < worst < TOLERANCES["bfloat16"]

    def test_a_dead_guard_is_an_alarm_in_the_journal(self, loop_run):
        """The guard died at its first snapshot inside the rollout actor (the engine ran on): a warn alarm
        (signature engine_guard_dead, the error and its traceback) at step 0, and guard/alive 0."""
        lines = [json.loads(x) for x in (loop_run[0] / "metrics.jsonl").read_text().splitlines()]
        dead = [a for line in lines for a in line["alarms"] if a["details"].get("signature") == DEAD_SIGNATURE]
        assert [(a["step"], a["severity"]) for a in dead] == [(0, "warn")]
        assert "Error" in dead[0]["details"]["error"] and dead[0]["details"]["traceback"]
        assert [line["metrics"][ALIVE_METRIC] for line in lines] == [0.0]
