"""The real GRPO loop on a trained tiny model with a bfloat16 vLLM engine: healthy streams recorded
token by token, and the real-loop must-show of issue 14 (a healthy bf16 run does not halt).

    # the must-show: 200 steps, rlcheck's default MonitorConfig (halting on), a plot and a summary
    .venv/bin/python benchmarks/bench_real_loop.py --out runs/real-loop-bf16 --plot docs/real-loop-bf16.png
    # a healthy stream for benchmarks/field_fit.py: halting off, every step's tokens kept
    .venv/bin/python benchmarks/bench_real_loop.py --record --arch hybrid --steps 60 --out /work/field_data/hybrid-bf16
    # responses of 1024 tokens: the trained model goes on past its answer (ignore_eos)
    .venv/bin/python benchmarks/bench_real_loop.py --record --max-tokens 1024 --ignore-eos --prompts 4 --group 4 ...

The loop is `rlcheck.loop` (a vLLM engine in a Ray actor, the trainer as Ray actor(s), weight sync
through the object store) on the addition task, with the engine in `--engine-dtype` (bfloat16) and
the trainer in `--trainer-dtype` (float32): the field's usual pairing. The model is
`rlcheck.modelzoo.ensure_trained(arch)` (built on first use, ~4 CPU minutes); `--random` uses the
random model of the same arch instead. `--out` is the run directory: metrics.jsonl (the monitor's),
loop.jsonl (rewards, timings), tokens.npz (every step's per-token data, below), summary.json.

tokens.npz (compressed; M tokens, N sequences, S steps, concatenated over steps):
    logp_rollout, logp_train (M,) float32   the sampled token's logprob, engine and trainer
    mask (M,) bool, tokens (M,) int32       tokens that count, the sampled ids
    cu_seqlens (N+1,) int64                 sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    seq_step (N,) int32, prompt_len (N,) int16, weight_version (N,) int32
    steps (S,) int32, step_seq_cu (S+1,) int64   step j is sequences step_seq_cu[j]:step_seq_cu[j+1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

EDGE = 20
"""Steps at each end whose mean reward the summary compares."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arg = ap.add_argument
    arg("--out", required=True, help="run directory (must be missing or empty)")
    arg("--arch", default="hybrid", choices=("llama", "hybrid"), help="default %(default)s: the demo's model")
    arg("--model", help="model folder (default runs/models/<arch>-trained, or <arch>-random-2k with --random)")
    arg("--random", action="store_true", help="the random (untrained) model of the arch")
    arg("--steps", type=int, default=200)
    arg("--record", action="store_true", help="halting off (a healthy stream, recorded whole)")
    arg("--engine-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    arg("--trainer-dtype", default="float32", choices=("float32", "bfloat16"))
    arg("--trainer", default="hf", choices=("hf", "fsdp2", "deepspeed"))
    arg("--world-size", type=int, default=1)
    arg("--prompts", type=int, default=8, help="prompts per step")
    arg("--group", type=int, default=8, help="samples per prompt (G)")
    arg("--max-tokens", type=int, default=32)
    arg("--ignore-eos", action="store_true", help="sample max-tokens tokens whatever the model says")
    arg("--lr", type=float, default=5e-5, help="trainer AdamW lr (default %(default)s)")
    arg("--seed", type=int, default=0)
    arg("--plot", help="write the reward / mean |d| plot here (PNG)")
    arg("--replot", action="store_true", help="only redraw --plot from the run in --out (its summary.json)")
    return ap.parse_args(argv)


def model_path(args: argparse.Namespace) -> str:
    """The model folder, built on first use (trained, or random with a 2048-token context)."""
    from rlcheck.modelzoo import build_model, ensure_trained

    if args.random:
        path = Path(args.model or f"runs/models/{args.arch}-random-2k")
        if not (path / "config.json").is_file():
            build_model(args.arch, path, max_positions=2048)
        return str(path)
    return str(ensure_trained(args.model or f"runs/models/{args.arch}-trained", args.arch))


def loop_config(args: argparse.Namespace, model: str):
    from rlcheck.engines.vllm import VLLMConfig
    from rlcheck.loop import AdditionTask, LoopConfig
    from rlcheck.loop.presets import TINY_KV_CACHE_BYTES
    from rlcheck.trainers import TrainerConfig

    long = args.max_tokens > 64
    rollout = VLLMConfig(model=model, dtype=args.engine_dtype, seed=args.seed, engine_id="rollout0",
                         max_tokens=args.max_tokens, max_model_len=2048 if long else 1024,
                         kv_cache_bytes=(4 if long else 1) * TINY_KV_CACHE_BYTES,
                         sampling={"ignore_eos": True} if args.ignore_eos else {})
    trainer = TrainerConfig(model=model, backend=args.trainer, dtype=args.trainer_dtype, lr=args.lr,
                            seed=args.seed, micro_batch_tokens=4096 if long else 2048)
    return LoopConfig(rollout=rollout, trainer=trainer, world_size=1 if args.trainer == "hf" else args.world_size,
                      steps=args.steps, group_size=args.group,
                      task=AdditionTask(num_prompts=args.prompts, seed=args.seed))


def monitor_config(args: argparse.Namespace, cfg):
    """rlcheck's defaults (halting on) for the must-show; `--record`: the same with halting off."""
    from rlcheck.core.monitor import HaltConfig, MonitorConfig

    halt = HaltConfig(enabled=False) if args.record else HaltConfig()
    return MonitorConfig(run_dir=args.out, sinks=("jsonl",), halt=halt, resume=False,
                         context={"source": "benchmarks/bench_real_loop.py", "record": args.record, **cfg.context()})


class TokenRecorder:
    """The Monitor with every observed batch's per-token data kept on the side (see tokens.npz)."""

    def __init__(self, monitor, save_every: int = 25):
        self._monitor = monitor
        self.parts: list[dict[str, np.ndarray]] = []
        self.save_every = save_every
        """Steps between saves of tokens.npz during the run (a crash or a kill keeps the rest)."""

    def __getattr__(self, name: str):
        return getattr(self._monitor, name)

    def observe(self, step: int, batch, **kwargs):
        n = len(batch.request_ids)
        mask = np.ones(len(batch.logp_rollout), bool) if batch.mask is None else np.asarray(batch.mask, bool)
        meta = batch.meta or {}
        self.parts.append({
            "step": np.int32(step),
            "logp_rollout": np.asarray(batch.logp_rollout, np.float32),
            "logp_train": np.asarray(batch.logp_train, np.float32),
            "mask": mask,
            "tokens": np.asarray(batch.tokens if batch.tokens is not None else np.zeros(len(mask)), np.int32),
            "seq_lens": np.diff(np.asarray(batch.cu_seqlens, np.int64)),
            "prompt_len": np.array([len(p) for p in batch.prompt_tokens] if batch.prompt_tokens is not None
                                   else np.zeros(n), np.int16),
            "weight_version": np.asarray(batch.weight_version if batch.weight_version is not None
                                         else meta.get("weight_version", np.zeros(n)), np.int32),
        })
        return self._monitor.observe(step, batch, **kwargs)

    def save(self, path: Path) -> None:
        if not self.parts:
            return
        seq_lens = np.concatenate([p["seq_lens"] for p in self.parts])
        per_step = np.array([len(p["seq_lens"]) for p in self.parts])
        arrays = {k: np.concatenate([p[k] for p in self.parts])
                  for k in ("logp_rollout", "logp_train", "mask", "tokens", "prompt_len", "weight_version")}
        np.savez_compressed(
            path, **arrays,
            cu_seqlens=np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int64),
            seq_step=np.repeat([p["step"] for p in self.parts], per_step).astype(np.int32),
            steps=np.array([p["step"] for p in self.parts], np.int32),
            step_seq_cu=np.concatenate([[0], np.cumsum(per_step)]).astype(np.int64))


def run(args: argparse.Namespace) -> dict:
    from rlcheck.core.monitor import Monitor
    from rlcheck.loop import GRPOLoop, ray_session

    model = model_path(args)
    cfg = loop_config(args, model)
    t0 = time.perf_counter()
    with ray_session(num_cpus=4), Monitor(monitor_config(args, cfg)) as mon:
        recorder = TokenRecorder(mon, save_every=1 if args.max_tokens > 64 else 25)
        loop = GRPOLoop(cfg, recorder)
        try:
            result = loop.run(lambda step, report, info: _progress(step, report, info, recorder))
        finally:
            loop.close()
            recorder.save(Path(args.out) / "tokens.npz")
    summary = summarize_run(Path(args.out), result, time.perf_counter() - t0)
    summary.update(model=model, args={k: v for k, v in vars(args).items() if k != "plot"})
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _progress(step: int, report, info: dict, recorder: TokenRecorder) -> None:
    from rlcheck.core import metrics as K

    m = report.metrics
    alarms = ", ".join(f"{a.kind}/{a.severity} {a.metric}" for a in report.alarms)
    print(f"step {step:4d} |d| mean {m[K.ABS_DIFF_MEAN]:.2e} max {m[K.ABS_DIFF_MAX]:.2f} "
          f"reward {info.get('reward_mean', float('nan')):.3f} resp {m.get('loop/response_tokens_mean', 0):.0f} "
          f"{info.get('seconds', {}).get('total', 0):.1f}s {alarms}", flush=True)
    if (step + 1) % recorder.save_every == 0:  # a crash keeps most of the run
        recorder.save(Path(recorder.run_dir) / "tokens.npz")


def summarize_run(run_dir: Path, result, wall_s: float) -> dict:
    """Halts, steps with a warn (or worse) alarm, reward at both ends, timing."""
    rewards = result.rewards
    warn_steps = sorted({r.step for r in result.reports for a in r.alarms if a.severity in ("warn", "critical")})
    critical_steps = sorted({r.step for r in result.reports for a in r.alarms if a.severity == "critical"})
    kinds: dict[str, int] = {}
    for r in result.reports:
        for a in r.alarms:
            key = f"{a.kind}/{a.severity} {a.metric}"
            kinds[key] = kinds.get(key, 0) + 1
    k = min(EDGE, max(1, len(rewards) // 2)) if rewards else 0
    return {
        "steps_run": result.steps_run,
        "halted": result.halted,
        "halt_reason": result.reason,
        "halt_step": result.reports[-1].step if result.halted and result.reports else None,
        "steps_with_warn_or_worse": len(warn_steps),
        "steps_with_critical": len(critical_steps),
        "warn_step_list": warn_steps,
        "critical_step_list": critical_steps,
        "alarms_by_kind": kinds,
        "reward_first": float(np.mean(rewards[:k])) if k else None,
        "reward_last": float(np.mean(rewards[-k:])) if k else None,
        "reward_edge_steps": k,
        "wall_s": round(wall_s, 1),
        "median_step_s": round(statistics.median(t["total"] for t in result.timings), 3) if result.timings else None,
    }


def plot(run_dir: Path, out: Path, summary: dict) -> None:
    """Reward and mean |d| per step, the steps with alarms marked (warn orange, critical red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlcheck.core import metrics as K

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [{"step": r["step"], **r["metrics"]} for r in rows if K.ABS_DIFF_MEAN in r.get("metrics", {})]
    loop = [json.loads(line) for line in (run_dir / "loop.jsonl").read_text().splitlines() if line.strip()]
    fig, (ax_r, ax_d) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    steps_r = [x["step"] for x in loop if "reward_mean" in x]
    ax_r.plot(steps_r, [x["reward_mean"] for x in loop if "reward_mean" in x], lw=1, color="tab:green")
    ax_r.set_ylabel("mean reward")
    ax_d.semilogy([r["step"] for r in rows], [r[K.ABS_DIFF_MEAN] for r in rows], lw=1, color="tab:blue")
    ax_d.set_ylabel("mean |d| (nats)")
    ax_d.set_xlabel("step")
    at = {r["step"]: r[K.ABS_DIFF_MEAN] for r in rows}
    critical = [s for s in summary["critical_step_list"] if s in at]
    warn = [s for s in summary["warn_step_list"] if s in at and s not in set(critical)]
    ax_d.scatter(warn, [at[s] for s in warn], s=12, color="orange", zorder=3, label=f"warn alarm ({len(warn)} steps)")
    ax_d.scatter(critical, [at[s] for s in critical], s=30, marker="x", color="red", zorder=4,
                 label=f"critical alarm ({len(critical)} steps)")
    if summary["halted"] and summary["halt_step"] is not None:
        ax_d.axvline(summary["halt_step"], color="red", lw=1.5, label="halt")
    ax_d.legend(fontsize=8, loc="upper right")
    a = summary["args"]
    fig.suptitle(f"real loop: trained tiny {a['arch']}, vLLM {a['engine_dtype']} vs trainer {a['trainer_dtype']}; "
                 f"{summary['steps_run']} steps, halts {int(summary['halted'])}, "
                 f"warn steps {summary['steps_with_warn_or_worse']}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        plot(Path(args.out), Path(args.plot), json.loads((Path(args.out) / "summary.json").read_text()))
        return 0
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}, indent=1))
    if args.plot:
        plot(Path(args.out), Path(args.plot), summary)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
