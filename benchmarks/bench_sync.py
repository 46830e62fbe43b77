"""Weight sync time against model size: Ray's object store against the collective (gloo, bucketed).

    flock /tmp/rlcheck-bench.lock .venv/bin/python benchmarks/bench_sync.py [--sizes 10M,50M,200M,500M] [--repeats 3]
    .venv/bin/python benchmarks/bench_sync.py --replot       # the plot again from the JSON

Random Llama models (head_dim 64, as vLLM's CPU attention needs; the tiny model zoo's 2048-token
tokenizer) are built in bfloat16 under runs/models/sync-<size>; for each one a real trainer rank (an
hf `TrainerWorker` actor, world size 1, bf16) and a real rollout actor (vLLM bf16, in-process) are
started, and the trainer's weights are synced `--repeats` times each way through the loop's own code
(`rlcheck.loop.weight_sync`):

- gather: every rank gathers the full weights and rank 0 keeps them (`TrainerGroup.gather_weights`);
- object store: rank 0 returns them into Ray's object store, the rollout actor takes them and loads
  them (`RolloutWorker.sync_weights`): transfer = the call less the load, timed inside the actor;
- collective: rank 0 broadcasts the layout and the buckets (`--bucket-mb`) over the gloo group, the
  engine loads each bucket as it arrives: transfer = the joined call less the engine's load time.

Medians over the repeats go to benchmarks/data/sync_scaling.json, the plot to docs/sync-scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from rlcheck.loop.actors import RolloutWorker  # noqa: E402 - after the environment it reads

# size: (hidden, layers); MLP 4 x hidden, as many KV heads as heads, untied head: 16 h^2 a layer
SIZES = {"10M": (512, 2), "50M": (768, 5), "200M": (1024, 12), "500M": (1536, 13), "1B": (2048, 15)}
VOCAB = 2048


def build_llama(size: str, root: Path) -> Path:
    """A random bf16 Llama of about `size` parameters in root/sync-<size> (kept for reruns)."""
    out = root / f"sync-{size}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaForCausalLM

    from rlcheck.modelzoo.models import hf_config
    from rlcheck.modelzoo.tokenizer import save_tokenizer

    hidden, layers = SIZES[size]
    out.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(VOCAB, 1024, out)
    config = hf_config("llama", VOCAB, 2, {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                           "pad_token_id": tok.pad_token_id}, 1024)
    config.update({"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
                   "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64, "head_dim": 64,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(out)
    del model
    return out


class TimedRollout(RolloutWorker):
    """`RolloutWorker` whose object-store sync says how long the load inside the actor took."""

    def sync_weights(self, weights, version, spoil=None):
        t = time.perf_counter()
        super().sync_weights(weights, version, spoil)
        return {"load_s": time.perf_counter() - t}


class Engine:
    """What `rlcheck.loop.weight_sync` asks of the loop's rollout supervisor: actor, name, timeout, call."""

    def __init__(self, actor, timeout_s: float):
        self.actor, self.name, self.timeout_s = actor, "rollout bench", timeout_s

    def call(self, submit):
        from rlcheck.loop.recovery import join

        return join([submit(self.actor)], [self.name], self.timeout_s)[0]


def measure(model: Path, repeats: int, bucket_mb: float) -> dict:
    import ray

    from rlcheck.engines.vllm import VLLMConfig
    from rlcheck.loop.group import TrainerGroup
    from rlcheck.loop.weight_sync import CollectiveSync, WeightSyncConfig
    from rlcheck.trainers import TrainerConfig

    rollout = ray.remote(TimedRollout).options(num_cpus=1).remote(VLLMConfig(
        model=str(model), dtype="bfloat16", max_model_len=256, max_tokens=8, kv_cache_bytes=64 * 2**20))
    ray.get(rollout.weight_version.remote())
    group = TrainerGroup(TrainerConfig(model=str(model), backend="hf", dtype="bfloat16"), 1, call_timeout_s=1800)
    engine = Engine(rollout, 1800.0)
    collective = CollectiveSync(WeightSyncConfig("collective", bucket_mb=bucket_mb), group, engine, 600.0)
    rows: dict[str, list[dict]] = {"object-store": [], "collective": []}
    version = 0
    try:
        t = time.perf_counter()
        collective.open()
        open_s = time.perf_counter() - t
        for _ in range(repeats):
            for method in rows:
                version += 1
                t0 = time.perf_counter()
                group.gather_weights()
                t1 = time.perf_counter()
                if method == "object-store":
                    ref = group.workers[0].take_weights.remote()
                    load_s = engine.call(lambda a, ref=ref, v=version: a.sync_weights.remote(ref, v))["load_s"]
                    stats = {}
                else:
                    _, stats = collective._both(group.workers[0].send_weights.remote(collective.cfg.bucket_bytes),
                                                rollout.receive_weights.remote(version))
                    load_s = stats["load_s"]
                t2 = time.perf_counter()
                rows[method].append({"gather_s": t1 - t0, "transfer_s": t2 - t1 - load_s, "load_s": load_s,
                                     "sync_s": t2 - t1, "total_s": t2 - t0, **stats})
    finally:
        group.shutdown()
        ray.kill(rollout)
    num_bytes = sum(os.path.getsize(p) for p in model.glob("*.safetensors"))
    out = {"open_collective_s": open_s, "weights_bytes": num_bytes}
    for method, runs in rows.items():
        out[method] = {k: statistics.median(r[k] for r in runs) for k in ("gather_s", "transfer_s", "load_s", "sync_s", "total_s")}
        out[method]["transfer_gb_s"] = num_bytes / out[method]["transfer_s"] / 1e9
        if method == "collective":
            out[method]["buckets"] = runs[-1]["buckets"]
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    params = [r["num_params"] / 1e6 for r in results]
    for method, style, color in (("object-store", "o-", "tab:blue"), ("collective", "s-", "tab:green")):
        ax.plot(params, [r[method]["sync_s"] for r in results], style, color=color, label=f"{method}: transfer + load")
        ax.plot(params, [r[method]["transfer_s"] for r in results], style.replace("-", ":"), color=color, alpha=0.6,
                label=f"{method}: transfer only")
    ax.plot(params, [r["collective"]["gather_s"] for r in results], "^--", color="gray", label="rank-0 gather (both)")
    ax.set(xscale="log", yscale="log", xlabel="parameters (millions, bf16)", ylabel="seconds per sync",
           title="Weight sync into vLLM (CPU, 2 cores): object store vs gloo collective")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10M,50M,200M,500M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--models", default="runs/models")
    ap.add_argument("--out", default="benchmarks/data/sync_scaling.json")
    ap.add_argument("--plot", default="docs/sync-scaling.png")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    ap.add_argument("--append", action="store_true", help="keep --out's rows of other sizes (a size measured again is replaced)")
    args = ap.parse_args()
    if args.replot:
        return plot(json.loads(Path(args.out).read_text())["results"], Path(args.plot))
    from rlcheck.loop import ray_session

    results = json.loads(Path(args.out).read_text())["results"] if args.append and Path(args.out).exists() else []
    with ray_session(num_cpus=4):
        for size in args.sizes.split(","):
            model = build_llama(size, Path(args.models))
            cfg = json.loads((model / "config.json").read_text())
            h, n, i = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
            num_params = 2 * VOCAB * h + h + n * (4 * h * h + 3 * h * i + 2 * h)
            row = {"size": size, "num_params": num_params, "hidden": h, "layers": n, "load": os.getloadavg()[0],
                   **measure(model, args.repeats, args.bucket_mb)}
            print(json.dumps(row), flush=True)
            results = sorted([r for r in results if r["size"] != size] + [row], key=lambda r: r["num_params"])
            Path(args.out).write_text(json.dumps({"dtype": "bfloat16", "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                                                  "machine": f"{os.cpu_count()} CPUs", "results": results}, indent=1) + "\n")
    plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
