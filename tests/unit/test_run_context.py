"""The dump schema of sampling and engine (`rlcheck.core.run.context`): every producer's context (the
loop, TRL, verl, stress) written into a real dump round-trips through every reader (the schema's
`read_context`, replay's temperature, localize's dtype and tolerance, diagnose's note)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.run.context import Engine, Sampling, read_context, record
from rlcheck.core.run.dump import read_dump, write_dump
from rlcheck.forensics.localize import engine_dtype
from rlcheck.forensics.localize.compare import TOLERANCES, tolerance_for
from rlcheck.forensics.replay import resolve_temperature


def batch(n=4, length=6) -> StepBatch:
    rng = np.random.default_rng(0)
    lr = [rng.uniform(-3, -0.1, length) for _ in range(n)]
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=[x + 1e-6 for x in lr],
                                 request_ids=[f"r{i}" for i in range(n)],
                                 tokens=[np.arange(5, 5 + length) for _ in range(n)],
                                 prompt_tokens=[np.array([1, 2, 3]) for _ in range(n)])


class Supervisor:
    """The `RolloutSupervisor` call the loop makes to ask its engine how it runs (the actor's answer given)."""

    def __init__(self, settings):
        self.settings = settings

    def call(self, submit):
        return submit(SimpleNamespace(effective_settings=SimpleNamespace(remote=lambda: self.settings)))


def loop_dump(tmp_path, model):
    """The loop's producer: LoopConfig.context() in the Monitor, the engine's own dtype added as the loop
    does when its engine has started, a dump written by the Monitor. Raw logprobs at T = 0.7, dtype auto
    (the engine ran bfloat16)."""
    from rlcheck.loop.config import record_context
    from rlcheck.loop.presets import tiny_cpu

    cfg = tiny_cpu(model, trainer="hf")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.7, dtype="auto",
                                                               logprobs_mode="raw_logprobs"),
                              trainer=dataclasses.replace(cfg.trainer, temperature=0.7))
    with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), context=cfg.context())) as mon:
        record_context(mon, cfg, Supervisor({"dtype": "bfloat16", "enforce_eager": True}))
        return mon.dump(3, batch())


def trl_dump(tmp_path, model):
    """TRL's producer: `trl_context` of a trainer with a real GRPOConfig at T = 0.7, its colocated LLM in bf16."""
    trl = pytest.importorskip("trl")
    from rlcheck.integrations.trl.config import trl_context

    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, report_to=[], use_vllm=True,
                          vllm_mode="colocate", temperature=0.7)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype="torch.bfloat16")))
    trainer = SimpleNamespace(args=args, model=SimpleNamespace(config=SimpleNamespace(_name_or_path=str(model), model_type="llama")),
                              temperature=args.temperature, vllm_importance_sampling_correction=False,
                              vllm_generation=SimpleNamespace(llm=llm))
    return write_dump(tmp_path / "trl", batch(), step=3, context=trl_context(trainer))


def verl_dump(tmp_path, model):
    """verl's producer: `verl_context` of verl's own generated trainer config at T = 0.7, bfloat16."""
    omegaconf = pytest.importorskip("omegaconf")
    verl = pytest.importorskip("verl")
    from rlcheck.integrations.verl.context import verl_context

    config = omegaconf.OmegaConf.load(os.path.join(os.path.dirname(verl.__file__),
                                                   "trainer/config/_generated_ppo_trainer.yaml"))
    config.actor_rollout_ref.rollout.update(name="vllm", temperature=0.7, dtype="bfloat16")
    config.actor_rollout_ref.model.path = str(model)
    return write_dump(tmp_path / "verl", batch(), step=3, context=verl_context(config))


def stress_dump(tmp_path, model):
    """The stress producer: `write_stress` of a greedy float32 run."""
    from rlcheck.forensics.slots import SlotContext
    from rlcheck.forensics.stress.config import StressConfig
    from rlcheck.forensics.stress.report import write_stress
    from rlcheck.forensics.stress.results import StressResult

    n = 4
    cfg = StressConfig(model=str(model), num_requests=n, samples_per_prompt=2)
    res = StressResult(config=cfg, request_ids=tuple(map(str, range(n))), max_abs_diff=(1e-6,) * n,
                       first_divergence=(None,) * n, contexts=tuple(SlotContext(i) for i in range(n)),
                       fault_affected={}, num_blocks=9, num_steps=4, trace="slot trace", seconds={},
                       settings={"dtype": "float32", "enforce_eager": True})
    b = batch(n)
    rollouts = [SimpleNamespace(logprobs=b.logp_rollout[b.cu_seqlens[i]:b.cu_seqlens[i + 1]], token_ids=tuple(range(5, 11)))
                for i in range(n)]
    reference = [r.logprobs + 1e-6 for r in rollouts]
    return write_stress(tmp_path / "stress", res, [[1, 2, 3]] * n, rollouts, reference).dump_dir


# producer -> (what the engine's logprobs are at: T, the dtype it ran, its framework)
PRODUCERS = {
    "loop": (loop_dump, 1.0, "bfloat16", "loop"),  # raw logprobs: untempered
    "trl": (trl_dump, 0.7, "bfloat16", "trl"),
    "verl": (verl_dump, 0.7, "bfloat16", "verl"),
    "stress": (stress_dump, 1.0, "float32", "stress"),  # greedy: untempered
}


class TestRoundTrip:
    @pytest.mark.parametrize("producer", list(PRODUCERS))
    def test_each_producer_reads_back_in_every_reader(self, producer, tmp_path, tiny_model):
        """The dump each producer writes gives every reader the engine's logprob temperature and dtype."""
        make, temperature, dtype, framework = PRODUCERS[producer]
        model = tiny_model("llama")
        _, meta = read_dump(make(tmp_path, model))
        ctx = read_context(meta)
        assert (ctx.schema, ctx.framework, ctx.engine.name, ctx.engine.precision) == (1, framework, "vllm", dtype)
        assert ctx.model == str(model)
        assert ctx.model_type == "llama"  # what diagnose reads to know a state cause is impossible
        assert resolve_temperature(meta, None)[0] == temperature  # replay
        assert engine_dtype(meta) == dtype  # localize: the re-run's dtype, and its tolerance
        assert tolerance_for(engine_dtype(meta), "float32") == TOLERANCES[dtype]

    def test_loop_dump_diagnosed_with_its_sampling(self, tmp_path, tiny_model):
        """diagnose reads the same record: a logit-processing verdict on a loop dump names raw logprobs at T = 0.7."""
        from rlcheck.forensics.diagnose import Finding
        from rlcheck.forensics.diagnose.evidence import load_evidence
        from rlcheck.forensics.diagnose.notes import note_sampling

        verdict = Finding("logit_processing", 0.9, [])
        note_sampling(load_evidence(loop_dump(tmp_path, tiny_model("llama"))), verdict)
        assert "logprobs_mode=raw_logprobs at T=0.7" in verdict.evidence[0]


class TestReadContext:
    def test_schema_fields_written_and_read(self):
        """`record` writes what `read_context` reads, whole."""
        s = Sampling(temperature=0.6, logprobs_mode="processed_logprobs", processing={"top_p": 0.9}, max_tokens=8, n=4)
        e = Engine(name="vllm", dtype="bfloat16", configured_dtype="auto", tensor_parallel_size=2, kv_cache_bytes=1 << 20)
        ctx = read_context({"context": {"model": "m", **record(s, e)}})
        assert (ctx.sampling, ctx.engine, ctx.model) == (s, e, "m")

    @pytest.mark.parametrize(("context", "temperature", "precision"), [
        ({"engine": {"logprobs_mode": "raw_logprobs", "dtype": "auto"}, "sampling": {"temperature": 0.7}}, 1.0, None),
        ({"framework": "trl", "temperature": 0.7, "vllm_dtype": "bfloat16", "logit_processing": {}}, 0.7, "bfloat16"),
        ({"engine": "vllm", "sampling": {"greedy": True, "temperature": 0.0, "logprobs_mode": "raw_logprobs"}}, 1.0, None),
        ({"engine": {"dtype": "float32"}}, 1.0, "float32"),
        ({}, 1.0, None),
    ])
    def test_older_layouts(self, context, temperature, precision):
        """Dumps written before the schema: the loop's (logprobs_mode under engine), TRL's flat keys,
        stress's, a hand-written engine dtype, none at all."""
        ctx = read_context({"context": context})
        assert ctx.sampling.logprob_temperature()[0] == temperature and ctx.engine.precision == precision

    def test_auto_is_no_precision(self):
        """A configured "auto" with no dtype as it ran says nothing about the precision."""
        assert Engine(configured_dtype="auto").precision is None
        assert Engine(dtype="torch.float16", configured_dtype="auto").precision == "float16"
