"""rlcheck inside TRL's multi-turn tool loop: real trl 1.16 `GRPOTrainer`s (vLLM colocated on CPU, float32 on
both sides) with the tiny Llama trained on the calculator's dialogues, which calls the tool
(`rlcheck.integrations.trl.turns`): one given `tools=[add]`, one given `environment_factory=Calculator` (an
environment whose method `add` TRL exposes as the tool, one instance per rollout, reset before each).

One vLLM engine serves both runs (TRL pushes each trainer's weights into it at its first step and drops the
prefix cache). Each run: two healthy steps, then `retokenized-history@2` re-tokenizes the tool loop's prompts
as TRL did before #5224 (decoded to text, encoded again), so vLLM prefills other ids than prompt + completion +
suffix wherever the model sampled a tokenization that is not the canonical one.
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


class Calculator:
    """An environment for `environment_factory=`: TRL renders its public method `add` as the tool (the same
    schema as the function above) and calls it on the rollout's own instance."""

    def __init__(self):
        self.calls = 0
        self.resets = 0

    def reset(self, **_) -> None:
        self.resets += 1

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return a + b


def _answer_reward(completions, answer, **_):
    """1 for a last turn whose content is the sum, else 0 (plus a little for each tool call)."""
    out = []
    for messages, want in zip(completions, answer, strict=True):
        calls = sum(bool(m.get("tool_calls")) for m in messages if m.get("role") == "assistant")
        last = str(messages[-1].get("content") or "").strip() if messages else ""
        out.append(float(last == str(want)) + 0.1 * min(calls, 2))
    return out


def _dataset(n: int = 32, seed: int = 5):
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 100, (n, 3))
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "+".join(map(str, r))}] for r in rows],
                              "answer": [int(r.sum()) for r in rows]})


@dataclass
class ToolRun:
    trainer: Any
    halt: MismatchHalt | None
    batches: dict[int, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.trainer.args.output_dir, "rlcheck")

    def lines(self) -> list[dict]:
        with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def colocated():
    """The calculator model's path, with vLLM colocated in-process on CPU in fp32; the first trainer's engine is
    handed to every later one (TRL builds one per trainer)."""
    import trl.generation.vllm_generation as vg

    from rlcheck.modelzoo import ensure_trained

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    llm, engines = vg.LLM, []

    def shared(**kw):
        if not engines:
            engines.append(llm(**{"dtype": "float32", **kw}))
        return engines[0]

    mp.setattr(vg, "LLM", shared)
    yield str(ensure_trained("runs/models/llama-calculator", "llama", task="calculator"))
    mp.undo()


def _train(model: str, out, max_steps: int, **tooling) -> ToolRun:
    """A GRPO run through `RLCheckGRPOTrainer` with `tooling` (tools= or environment_factory=), the drill from
    ONSET; the batches each step's Monitor saw."""
    from trl import GRPOConfig

    from rlcheck.core.monitor import MonitorConfig
    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

    args = GRPOConfig(output_dir=str(out), max_steps=max_steps, learning_rate=1e-5, logging_steps=1,
                      save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, bf16=False, seed=0,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=160,
                      use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
                      vllm_gpu_memory_utilization=0.05)
    trainer = RLCheckGRPOTrainer(model=model, reward_funcs=_answer_reward, args=args, train_dataset=_dataset(),
                                 monitor=MonitorConfig(run_dir=out / "rlcheck", sinks=("jsonl",)),
                                 rlcheck_options=TRLOptions(inject=f"retokenized-history@{ONSET}"), **tooling)
    run = ToolRun(trainer, None)
    hook_observe = trainer.rlcheck._observe  # the hook's Monitor step (train() opens a fresh Monitor: spy above it)

    def spy(step, batch, extra, *rest):  # rest: the measured floor's sample
        run.batches[step] = batch
        return hook_observe(step, batch, extra, *rest)

    trainer.rlcheck._observe = spy
    try:
        trainer.train()
    except MismatchHalt as exc:
        run.halt = exc
    return run


@pytest.fixture(scope="module")
def tool_run(colocated, tmp_path_factory):
    return _train(colocated, tmp_path_factory.mktemp("trl-tools"), 4, tools=[add])


@pytest.fixture(scope="module")
def env_run(colocated, tmp_path_factory):
    # up to 6 drill steps: the prefix breaks only in rows where the model sampled a non-canonical tokenization
    # (1 of 8 rows at the tools run's first drill step); the halt ends the run at the first one
    return _train(colocated, tmp_path_factory.mktemp("trl-env"), ONSET + 6, environment_factory=Calculator)


def _laid_with_calls(run: ToolRun) -> None:
    """The model calls the tool: rows of 2-3 turns (runs of the tool mask), each laid with vLLM's calls, every
    next prompt = prompt + completion + suffix (token-in/token-out) before the drill."""
    batch = run.batches[0]
    counts = batch.turns.turn_counts(batch.cu_seqlens)
    assert batch.turns.source == "mask_runs" and counts.max() >= 3
    records = [r for r in batch.turns.records if r is not None]
    assert len(records) >= len(counts) // 2
    for r in records:
        assert r.num_turns == len(r.prompt_ids)
        for k in range(len(r.prompt_ids) - 1):
            head = np.concatenate([r.prompt_ids[k], r.output_ids[k]])
            assert (r.prompt_ids[k + 1][: len(head)] == head).all()


def _healthy_before_the_drill(run: ToolRun) -> list[dict]:
    """Steps before the drill: fp32 agreement on the model's tokens, no alarm; their journal lines."""
    lines = [line for line in run.lines() if line["step"] < ONSET]
    assert [line["step"] for line in lines] == list(range(ONSET))
    assert all(not line["alarms"] and line["metrics"][K.ABS_DIFF_MEAN] < 1e-4 for line in lines)
    return lines


def _broken_prefixes(run: ToolRun) -> int:
    """Calls whose prompt leaves the previous call's prompt + completion, from the drill on."""
    broken = 0
    for step, batch in run.batches.items():
        if step < ONSET:
            continue
        for r in (r for r in batch.turns.records if r is not None):
            for k in range(len(r.prompt_ids) - 1):
                head = np.concatenate([r.prompt_ids[k], r.output_ids[k]])
                broken += not np.array_equal(r.prompt_ids[k + 1][: len(head)], head)
    return broken


@pytest.mark.slow
@pytest.mark.extended  # the calculator model trains ~8 minutes: make test-extended
@pytest.mark.timeout(900)
class TestTRLTools:
    @pytest.mark.supports("TRL", "tools", "tools= (multi-turn)")
    def test_turns_from_the_tool_mask_with_vllms_calls(self, tool_run):
        _laid_with_calls(tool_run)

    def test_healthy_steps_are_clean(self, tool_run):
        _healthy_before_the_drill(tool_run)

    def test_retokenized_history_breaks_the_prefix(self, tool_run):
        """From the drill on, vLLM's later prompts leave prompt + completion inside a turn in some rows."""
        assert _broken_prefixes(tool_run) > 0


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1200)
class TestTRLEnvironmentFactory:
    @pytest.mark.supports("TRL", "tools", "environment_factory= (multi-turn)")
    def test_the_environments_method_is_the_tool(self, env_run):
        """TRL built one Calculator per rollout, reset each, and the model called their `add`; the rows' turns are
        laid with vLLM's calls as with tools=."""
        pool = env_run.trainer._environment_pool[None]
        assert len(pool) >= 8 and all(e.resets >= 1 for e in pool)
        assert sum(e.calls for e in pool) > 0
        _laid_with_calls(env_run)

    def test_per_turn_statistics_and_quiet_healthy_steps(self, env_run):
        """The journal's healthy steps carry the per-turn statistics (turns 0 and 1, the later and the last turns,
        the tool tokens out of the loss), fp32-level on each, no alarm and no broken invariant."""
        for line in _healthy_before_the_drill(env_run):
            m = line["metrics"]
            assert m[K.TURN_COUNT] > m[K.turn_metric(0, "turns")] and m[K.TURN_TOOL_TOKENS] > 0
            for slot in (0, 1, "later", "last"):
                assert m[K.turn_metric(slot, "tokens")] > 0
                assert m[K.turn_metric(slot, "abs_diff_mean")] < 1e-4
            assert all(m.get(K.turn_invariant(name), 0) == 0 for name in K.TURN_INVARIANTS)

    def test_retokenized_history_caught_and_named(self, env_run):
        """The drill breaks the prefix, the invariant alarms and halts the run, and diagnose names it."""
        from rlcheck.forensics.diagnose import diagnose

        assert _broken_prefixes(env_run) > 0
        assert env_run.halt is not None
        drilled = [line for line in env_run.lines() if line["step"] >= ONSET]
        assert drilled and drilled[-1]["alarms"]
        assert drilled[-1]["metrics"][K.turn_invariant("prefix_break")] >= 1
        assert diagnose(env_run.run_dir).verdict.cause == "retokenized_history"
