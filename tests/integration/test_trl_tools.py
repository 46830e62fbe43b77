"""rlcheck inside TRL's multi-turn tool loop: a real trl 1.16 `GRPOTrainer(tools=[add])` (vLLM colocated on
CPU, float32 on both sides) with the tiny Llama trained on the calculator's dialogues, which calls the tool
(`rlcheck.integrations.trl.turns`).

One run serves the tests: two healthy steps, then `retokenized-history@2` re-tokenizes the tool loop's
prompts as TRL did before #5224 (decoded to text, encoded again), so vLLM prefills other ids than
prompt + completion + suffix wherever the model sampled a tokenization that is not the canonical one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.errors import MismatchHalt

pytest.importorskip("trl")
pytest.importorskip("vllm")

ONSET = 2


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def _answer_reward(completions, answer, **_):
    """1 for a last turn whose content is the sum, else 0 (plus a little for each tool call)."""
    out = []
    for messages, want in zip(completions, answer, strict=True):
        calls = sum(bool(m.get("tool_calls")) for m in messages if m.get("role") == "assistant")
        last = str(messages[-1].get("content") or "").strip() if messages else ""
        out.append(float(last == str(want)) + 0.1 * min(calls, 2))
    return out


def _dataset(n: int = 32):
    from datasets import Dataset

    rng = np.random.default_rng(5)
    rows = rng.integers(0, 100, (n, 3))
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "+".join(map(str, r))}] for r in rows],
                              "answer": [int(r.sum()) for r in rows]})


@dataclass
class ToolRun:
    trainer: Any
    halt: MismatchHalt | None
    batches: dict[int, Any] = field(default_factory=dict)

    def lines(self) -> list[dict]:
        with open(os.path.join(self.trainer.args.output_dir, "rlcheck", "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    import trl.generation.vllm_generation as vg
    from trl import GRPOConfig

    from rlcheck.core.monitor import MonitorConfig
    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions
    from rlcheck.modelzoo import ensure_trained

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    llm = vg.LLM
    mp.setattr(vg, "LLM", lambda **kw: llm(**{"dtype": "float32", **kw}))
    model = str(ensure_trained("runs/models/llama-calculator", "llama", task="calculator"))
    out = tmp_path_factory.mktemp("trl-tools")
    args = GRPOConfig(output_dir=str(out), max_steps=4, learning_rate=1e-5, logging_steps=1, save_strategy="no",
                      report_to=[], disable_tqdm=True, use_cpu=True, bf16=False, seed=0,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=160,
                      use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
                      vllm_gpu_memory_utilization=0.05)
    trainer = RLCheckGRPOTrainer(model=model, reward_funcs=_answer_reward, args=args, train_dataset=_dataset(),
                                 tools=[add], monitor=MonitorConfig(run_dir=out / "rlcheck", sinks=("jsonl",)),
                                 rlcheck_options=TRLOptions(inject=f"retokenized-history@{ONSET}"))
    run = ToolRun(trainer, None)
    hook_observe = trainer.rlcheck._observe  # the hook's Monitor step (train() opens a fresh Monitor: spy above it)

    def spy(step, batch, extra):
        run.batches[step] = batch
        return hook_observe(step, batch, extra)

    trainer.rlcheck._observe = spy
    try:
        trainer.train()
    except MismatchHalt as exc:
        run.halt = exc
    yield run
    mp.undo()


@pytest.mark.slow
@pytest.mark.extended  # the calculator model trains ~8 minutes: make test-extended
@pytest.mark.timeout(900)
class TestTRLTools:
    @pytest.mark.supports("TRL", "tools", "tools= (multi-turn)")
    def test_turns_from_the_tool_mask_with_vllms_calls(self, tool_run):
        """The model calls the tool: rows of 2-3 turns (runs of the tool mask), each laid with vLLM's calls,
        every next prompt = prompt + completion + suffix (token-in/token-out) before the drill."""
        batch = tool_run.batches[0]
        counts = batch.turns.turn_counts(batch.cu_seqlens)
        assert batch.turns.source == "mask_runs" and counts.max() >= 3
        records = [r for r in batch.turns.records if r is not None]
        assert len(records) >= len(counts) // 2
        for r in records:
            assert r.num_turns == len(r.prompt_ids)
            for k in range(len(r.prompt_ids) - 1):
                head = np.concatenate([r.prompt_ids[k], r.output_ids[k]])
                assert (r.prompt_ids[k + 1][: len(head)] == head).all()

    def test_healthy_steps_are_clean(self, tool_run):
        """Steps before the drill: fp32 agreement on the model's tokens, no alarm."""
        lines = [line for line in tool_run.lines() if line["step"] < ONSET]
        assert [line["step"] for line in lines] == list(range(ONSET))
        assert all(not line["alarms"] and line["metrics"][K.ABS_DIFF_MEAN] < 1e-4 for line in lines)

    def test_retokenized_history_breaks_the_prefix(self, tool_run):
        """From the drill on, vLLM's later prompts leave prompt + completion inside a turn in some rows."""
        broken = 0
        for step, batch in tool_run.batches.items():
            if step < ONSET:
                continue
            for r in (r for r in batch.turns.records if r is not None):
                for k in range(len(r.prompt_ids) - 1):
                    head = np.concatenate([r.prompt_ids[k], r.output_ids[k]])
                    broken += not np.array_equal(r.prompt_ids[k + 1][: len(head)], head)
        assert broken > 0
