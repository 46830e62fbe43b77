"""The environments of the docs' snippets that need vLLM, Ray, TRL or verl (tests/docs_snippets.py): each
runs in a process of its own, from tests/integration/test_docs_snippets.py."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from tests.docs_envs import Env, environ, journal, patched, tiny_model


@contextlib.contextmanager
def _engines() -> Iterator[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from rlcheck.modelzoo import build_model

    trainer_model = AutoModelForCausalLM.from_pretrained(build_model("hybrid", "models/hybrid"))
    yield {"prompt_token_ids": [[1, 2, 3, 4], [5, 6, 7]], "trainer_model": trainer_model}


def _check_engines(ns: dict[str, Any], out: str) -> None:
    assert len(ns["rollouts"]) == 8 and ns["batch"].num_sequences == 8


@contextlib.contextmanager
def _guard() -> Iterator[dict[str, Any]]:
    with tiny_model("hybrid", "runs/models/hybrid"):
        yield {"prompts": [[1, 2, 3, 4], [5, 6, 7]]}


@contextlib.contextmanager
def _ray_loop() -> Iterator[dict[str, Any]]:
    """The page's loop for 2 steps instead of 20 (the test's only change)."""
    from rlcheck.loop import presets

    real = presets.tiny_cpu

    def two_steps(*args: Any, **kwargs: Any):
        return dataclasses.replace(real(*args, **kwargs), steps=2)

    with tiny_model("hybrid", "runs/models/hybrid"), patched(presets, "tiny_cpu", two_steps):
        yield {}


def _check_ray_loop(ns: dict[str, Any], out: str) -> None:
    assert not ns["result"].halted and len(journal("runs/grpo")) == 2


@contextlib.contextmanager
def _trl() -> Iterator[dict[str, Any]]:
    """The page's trainer on CPU at test size, with a fire drill so that its `except MismatchHalt` runs:
    `models/qwen-0.5b` is a tiny Llama, GRPOConfig gets CPU-sized defaults (what you would pass on a
    CPU), and TRLOptions() leaves out vLLM's weight sync from step 1 (stale-weights@1)."""
    import trl
    from datasets import Dataset

    from rlcheck.integrations import trl as rlcheck_trl

    real_config, real_options = trl.GRPOConfig, rlcheck_trl.TRLOptions

    def cpu_config(**kwargs: Any):
        small = {"max_steps": 3, "use_cpu": True, "report_to": [], "save_strategy": "no", "disable_tqdm": True,
                 "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
                 "vllm_max_model_length": 128, "vllm_gpu_memory_utilization": 0.05, "learning_rate": 5e-2}
        return real_config(**{**small, **kwargs})

    @dataclasses.dataclass(frozen=True)
    class DrillOptions(real_options):
        inject: str | None = "stale-weights@1"

    def my_reward(completions, **_):
        return [float(len(c)) for c in completions]

    with (environ(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", WANDB_MODE="offline",
                   WANDB_SILENT="true"),
          tiny_model("llama", "models/qwen-0.5b"), patched(trl, "GRPOConfig", cpu_config),
          patched(rlcheck_trl, "TRLOptions", DrillOptions)):
        yield {"my_reward": my_reward,
               "ds": Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})}


def _check_trl(ns: dict[str, Any], out: str) -> None:
    assert "runs/grpo/rlcheck/dumps/step_000001" in out, out[-2000:]


def _verl_batch(rows: int = 16, samples: int = 2, corrupt: int | None = None, seed: int = 0):
    """(batch, old_log_prob): a step's DataProto as verl's driver holds it before the union, and the
    actor's recomputation. `corrupt`: that row is confident gibberish (engine ~0, actor -4 nats)."""
    import uuid

    import torch
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    prompt_len, response_len = 6, 10
    lengths = torch.randint(3, response_len + 1, (rows,), generator=gen)
    mask = (torch.arange(response_len) < lengths[:, None]).long()  # (B, R)
    prompts = torch.randint(1, 100, (rows, prompt_len), generator=gen)
    responses = torch.randint(1, 100, (rows, response_len), generator=gen) * mask
    rollout = -2.0 * torch.rand(rows, response_len, generator=gen) * mask
    old = (rollout + 1e-3 * torch.randn(rows, response_len, generator=gen)).clamp(max=0.0) * mask
    if corrupt is not None:
        mask[corrupt] = 1
        rollout[corrupt], old[corrupt] = -0.001, -4.0
    uids = np.repeat([str(uuid.UUID(int=i)) for i in range(rows // samples)], samples).astype(object)
    batch = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": mask,
                 "input_ids": torch.cat([prompts, responses], 1), "rollout_log_probs": rollout,
                 "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1)},
        non_tensors={"uid": uids})
    return batch, DataProto.from_dict(tensors={"old_log_probs": old})


@contextlib.contextmanager
def _verl(corrupt: int | None = None) -> Iterator[dict[str, Any]]:
    """What `RayPPOTrainer.fit` holds where the page's lines go: `self` (its step counter), the step's
    batch, the actor's old log probs and the step's metrics."""
    batch, old_log_prob = _verl_batch(corrupt=corrupt)
    yield {"self": types.SimpleNamespace(global_steps=1), "batch": batch, "old_log_prob": old_log_prob,
           "metrics": {"training/rollout_probs_diff_mean": 0.001}}


def _check_verl(ns: dict[str, Any], out: str) -> None:
    assert len(journal("runs/verl-gsm8k")) == 1 and "old_log_probs" in ns["batch"].batch.keys()


def _check_verl_quarantine(ns: dict[str, Any], out: str) -> None:
    report, batch = ns["report"], ns["batch"]
    assert [q.index for q in report.quarantined] == [3], report.quarantined
    assert int(batch.batch["response_mask"][3].sum()) == 0 and "rollout_is_weights" in batch.batch.keys()


SLOW_ENVS: dict[str, Env] = {
    "engines": Env(_engines, _check_engines, slow=True),
    "guard": Env(_guard, slow=True),
    "ray-loop": Env(_ray_loop, _check_ray_loop, slow=True),
    "trl": Env(_trl, _check_trl, slow=True),
    "verl": Env(_verl, _check_verl, slow=True),
    "verl-quarantine": Env(lambda: _verl(corrupt=3), _check_verl_quarantine, slow=True),
}
