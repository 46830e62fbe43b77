"""GRPO on CPU with rlcheck between the rollout engine and the trainer: the default recipe.

A ~1M-parameter hybrid model (Mamba2 + attention, `rlcheck.modelzoo`), first trained on the task for
a few CPU minutes (`ensure_trained`, once; `--model runs/models/hybrid` takes the random one), learns to add two numbers
(`rlcheck.loop.task.AdditionTask`). Each step vLLM (CPU backend, in a Ray actor) samples G answers
per prompt, a sharded trainer (FSDP2 or DeepSpeed ZeRO-3 over `--world-size` Ray actors, gloo;
or plain HF on one process) recomputes their logprobs, the Monitor compares the two, the trainer
takes one clipped-surrogate step and the new weights go back to vLLM. `loop_config` and
`monitor_config` below build the run's configs field by field, so every knob is in view; the loop's
values are those of `rlcheck.loop.presets.tiny_cpu`, which `rlcheck demo` runs.

    .venv/bin/python recipes/grpo_tiny.py                                 # FSDP2, 2 ranks, 20 steps
    .venv/bin/python recipes/grpo_tiny.py --trainer deepspeed --steps 40
    .venv/bin/python recipes/grpo_tiny.py --trainer hf --world-size 1
    .venv/bin/python recipes/grpo_tiny.py --inject skip-sync-every=4 --steps 100   # a sync left out every 4 steps
    .venv/bin/python recipes/grpo_tiny.py --wandb                         # also log to W&B (offline)

The model is built on first use into `--model` (default runs/models/hybrid-trained: trained; a folder
not named `<arch>-trained` gets the random hybrid). The run's files
(metrics.jsonl, loop.jsonl, state.json, dumps/ on a halt) go to `--run-dir`; read them with
`rlcheck summarize RUN_DIR`. Prints one line per step and a summary; exits 1 if the monitor halted
the run. On 2 shared CPU cores a step took 1.4-2 s, after ~45 s of start-up (Ray, vLLM, the ranks).
The detectors learn the run's own baseline over their first 32 steps (`warmup`) and do not fire
before; the periodic one needs more history still, so give a fault run ~100 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _cluster import add_cluster_args, placement, ray_address

from rlcheck.core import metrics as K
from rlcheck.core.detect import DetectorsConfig
from rlcheck.core.monitor import HaltConfig, Monitor, MonitorConfig, StepReport
from rlcheck.core.stats import StatsConfig
from rlcheck.engines.vllm import VLLMConfig
from rlcheck.errors import RLCheckError
from rlcheck.faults import parse_inject
from rlcheck.loop import PHASES, AdditionTask, LoopConfig, LoopResult, ray_session, run_grpo
from rlcheck.sinks import WandbConfig
from rlcheck.trainers import BACKENDS, TrainerConfig

DEFAULT_MODEL = "runs/models/hybrid-trained"  # where `rlcheck demo` builds it too


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arg = ap.add_argument
    arg("--model", default=DEFAULT_MODEL,
        help="model directory; a tiny hybrid is built there if it holds none, trained when the folder is "
             "named <arch>-trained (default: %(default)s)")
    arg("--trainer", choices=BACKENDS, default="fsdp2", help="trainer backend (default: %(default)s)")
    arg("--world-size", type=int, help="trainer ranks (default: 2; 1 for hf)")
    arg("--steps", type=int, default=20, help="GRPO steps, fewer if the monitor halts (default: %(default)s)")
    arg("--run-dir", help="run directory (default: runs/grpo-tiny-<time>)")
    arg("--inject", help="a fault to inject, as NAME=VALUE, e.g. skip-sync-every=4")
    arg("--wandb", nargs="?", const="offline", choices=("offline", "online"),
        help="also log to W&B: offline (the bare flag) or online")
    add_cluster_args(ap, address="local")  # a private Ray here; `auto` or HOST:PORT joins a cluster
    args = ap.parse_args(argv)
    if args.world_size is None:
        args.world_size = 1 if args.trainer == "hf" else 2
    if args.run_dir is None:
        args.run_dir = os.path.join("runs", time.strftime("grpo-tiny-%Y%m%d-%H%M%S"))
    return args


def ensure_model(path: str) -> str:
    """The model directory, built when it holds no model yet (`rlcheck.modelzoo.ensure_model`):
    trained on the task for a folder named `<arch>-trained`, else the random tiny hybrid. Absolute:
    the actors resolve it in their own working directory, on their own node."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        from rlcheck.modelzoo import ensure_model as build_missing

        print(f"building the tiny model into {path} (a trained one takes a few CPU minutes, once)", flush=True)
        build_missing(path)
    return os.path.abspath(path)


def loop_config(args: argparse.Namespace, model: str) -> LoopConfig:
    temperature = 1.0  # vLLM samples at it and the trainer scores at it: the two must be equal
    rollout = VLLMConfig(
        model=model,
        dtype="float32",
        seed=0,
        engine_id="rollout0",
        temperature=temperature,
        max_tokens=32,  # an answer is a few digits; the rest is what a random model babbles
        max_model_len=1024,
        kv_cache_bytes=64 << 20,  # on CPU: without it vLLM reserves 92% of the machine's RAM
        enforce_eager=True,  # torch.compile would add ~30 s to the engine start
    )
    trainer = TrainerConfig(
        model=model,
        backend=args.trainer,
        zero_stage=3,  # deepspeed only
        dtype="float32",
        lr=1e-5,
        max_grad_norm=1.0,
        clip_low=0.2,
        clip_high=0.2,
        temperature=temperature,
        micro_batch_tokens=2048,
        seed=0,
        device="cpu",
    )
    return LoopConfig(
        rollout=rollout,
        trainer=trainer,
        world_size=args.world_size,
        steps=args.steps,
        group_size=8,
        task=AdditionTask(max_operand=99, num_prompts=8, seed=0),
        placement=placement(args, trainer_cpus=1, rollout_cpus=1),
        fault=parse_inject(args.inject),
    )


def monitor_config(run_dir: str, cfg: LoopConfig, recipe: str, wandb_mode: str | None = None,
                   wandb_project: str = "rlcheck") -> MonitorConfig:
    """The monitor of a recipe's run (the GPU recipes use this one too)."""
    return MonitorConfig(
        run_dir=run_dir,
        sinks=("jsonl", "wandb") if wandb_mode else ("jsonl",),
        stats=StatsConfig(),  # |d| thresholds, divergence and catastrophe levels, offenders kept
        detectors=DetectorsConfig(),  # threshold, robust z, drift, periodic, signatures; None turns one off
        halt=HaltConfig(enabled=True, min_severity="critical", patience=1),
        wandb=WandbConfig(project=wandb_project, mode=wandb_mode, tags=(recipe,)) if wandb_mode else None,
        resume=False,  # a fresh run directory; an existing run there is refused, not overwritten
        context={"recipe": recipe, **cfg.context()},
    )


def print_step(step: int, report: StepReport, info: dict) -> None:
    """One line: mismatch, reward, loss, phase seconds, alarms."""
    m = report.metrics
    line = f"step {step:4d}  |d| mean {m[K.ABS_DIFF_MEAN]:.2e} max {m[K.ABS_DIFF_MAX]:.2e}"
    if info.get("halted"):
        print(f"{line}  HALT: {report.halt_reason}", flush=True)
        return
    secs = info["seconds"]
    phases = " ".join(f"{p} {secs.get(p, 0.0):.3f}" for p in PHASES)
    line += f"  reward {info['reward_mean']:.3f}  loss {info['train']['loss']:+.3g}  s: {phases}"
    if info.get("sync_skipped"):
        line += "  (sync skipped)"
    alarms = ", ".join(f"{a.kind}/{a.severity} {a.metric}" for a in report.alarms)
    print(line + (f"  alarms: {alarms}" if alarms else ""), flush=True)


def print_summary(result: LoopResult, run_dir: str) -> None:
    alarms = [a for r in result.reports for a in r.alarms]
    print(f"\n{result.steps_run} steps, {len(alarms)} alarms; run directory {run_dir}")
    if result.rewards:
        k = max(1, len(result.rewards) // 4)
        print(f"mean reward: first {k} steps {statistics.fmean(result.rewards[:k]):.3f}, "
              f"last {k} steps {statistics.fmean(result.rewards[-k:]):.3f}")
    if result.timings:
        total = statistics.median(t["total"] for t in result.timings)
        monitor = statistics.median(t["monitor"] / t["total"] for t in result.timings)
        print(f"median step {total:.2f} s, of it the monitor {monitor:.2%}")
    for r in result.restarts:
        print(f"engine restarted at step {r.step} ({r.phase}: {r.cause}) in {r.seconds:.1f} s")
    if result.halted:
        print(f"HALTED: {result.reason}\nevidence: {result.dump_dir}")
    if result.error is not None:
        print(f"lost actor: {result.error}")
    print(f"inspect: rlcheck summarize {run_dir}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = loop_config(args, ensure_model(args.model))
        with ray_session(address=ray_address(args), num_cpus=4), \
                Monitor(monitor_config(args.run_dir, cfg, "grpo_tiny", args.wandb)) as monitor:
            result = run_grpo(cfg, monitor, print_step)
    except RLCheckError as exc:
        print(f"grpo_tiny: error: {exc}", file=sys.stderr)
        return 2
    print_summary(result, args.run_dir)
    return 1 if result.halted else 0


if __name__ == "__main__":
    sys.exit(main())
