"""`rlcheck localize` time for 10 requests of 64 tokens on the real vLLM CPU engine and the tiny hybrid.

    .venv/bin/python benchmarks/bench_localize.py [--model DIR] [--requests 10] [--tokens 64] [--layer 2] [--repeat 2]

What it times (fp32, greedy; the HF reference loaded once beforehand, as a session would):
- "stress re-run": a `rlcheck stress` output of --requests requests (1 per prompt, prompts of 4-16
  tokens, --tokens generated each, all live at once) with `perturb-layer=--layer` injected, localized
  whole: `localize(out)` starts its own engine, re-runs the workload with the fault and hooks on every
  decoder layer, scores every request's hidden states with HF and compares them, writes localize.json
  and the plot. Split into engine (start + re-run + capture) and reference (HF + comparison);
- "teacher-forced": the same sequences as a plain dump (no stress.json), one prefill per request;
- both again with an engine already started (`engine=`): the cost without vLLM's start;
- "generate alone": that engine's plain `generate` of the same prompts (the capture's overhead is the
  difference to the re-run).
Each request must name layer --layer. Prints a markdown table; the best of --repeat per row.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def plain_dump(stress_dir: str, out: Path, model: str) -> Path:
    """The stress output's sequences as an ordinary dump (context: model, engine dtype, the fault)."""
    from rlcheck.core.batch import StepBatch
    from rlcheck.core.run.dump import read_dump, write_dump

    rows, meta = read_dump(stress_dir)
    fault = meta["context"]["stress"]
    batch = StepBatch.from_ragged(logp_rollout=[r["logp_rollout"] for r in rows], logp_train=[r["logp_train"] for r in rows],
                                  request_ids=[r["request_id"] for r in rows], tokens=[r["response_tokens"] for r in rows],
                                  prompt_tokens=[r["prompt_tokens"] for r in rows])
    return write_dump(out, batch, step=0, context={"model": model, "engine": {"dtype": "float32"},
                                                   "fault": f"perturb-layer={fault['layer']}"})


def check(result, layer: int) -> str:
    named = sum(r.first_divergent_layer == layer and r.position == 0 for r in result.requests)
    return f"{named}/{len(result.requests)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder [default: build the tiny hybrid]")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from rlcheck.engines import vllm_faults
    from rlcheck.forensics.localize import localize
    from rlcheck.forensics.replay import load_scorer
    from rlcheck.forensics.stress import StressConfig, engine_config, run_stress
    from rlcheck.modelzoo import build_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-localize-"))
    model = args.model or str(build_model("hybrid", tmp / "hybrid"))
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    scorer = load_scorer(Path(model))
    cfg = StressConfig(model=model, num_requests=args.requests, samples_per_prompt=1, max_tokens=args.tokens,
                       max_num_seqs=max(args.requests, 1), fault="perturb-layer", layer=args.layer)
    res = run_stress(cfg, tmp / "stress", scorer=scorer)
    forced = plain_dump(res.dump_dir, tmp / "plain", model)
    tokens = sum(len(p) + args.tokens - 1 for p in scorer_prompts(res.dump_dir))
    print(f"{args.requests} requests x {args.tokens} tokens, {tokens} positions compared per run; "
          f"{len(res.failing)} of them fail the stress threshold")
    print("| run | engine | wall s | engine s | reference s | named layer " + str(args.layer) + " |")
    print("|---|---|---|---|---|---|")
    for name, path in (("stress re-run", res.dump_dir), ("teacher-forced", forced)):
        best = min((timed(lambda p=path: localize(p, scorer=scorer)) for _ in range(args.repeat)), key=lambda t: t[0])
        s = best[1].seconds
        print(f"| {name} | started by localize | {best[0]:.1f} | {s['engine']:.1f} | {s['reference']:.1f} | "
              f"{check(best[1], args.layer)} |", flush=True)
    from rlcheck.engines.vllm import VLLMEngine

    engine = VLLMEngine(engine_config(cfg))
    handle = vllm_faults.inject(engine, "perturb-layer", layer=args.layer)
    try:
        for name, path in (("stress re-run", res.dump_dir), ("teacher-forced", forced)):
            best = min((timed(lambda p=path: localize(p, scorer=scorer, engine=engine)) for _ in range(args.repeat)),
                       key=lambda t: t[0])
            s = best[1].seconds
            print(f"| {name} | already started | {best[0]:.1f} | {s['engine']:.1f} | {s['reference']:.1f} | "
                  f"{check(best[1], args.layer)} |", flush=True)
        prompts = scorer_prompts(res.dump_dir)
        gen = min(timed(lambda: engine.generate(prompts, step=0))[0] for _ in range(args.repeat))
        print(f"| generate alone (no capture) | already started | {gen:.2f} | {gen:.2f} | - | - |")
    finally:
        handle.remove()
        engine.close()
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


def scorer_prompts(dump_dir: str) -> list[list[int]]:
    from rlcheck.forensics.replay import load_sequences

    return load_sequences(dump_dir).prompts


if __name__ == "__main__":
    main()
