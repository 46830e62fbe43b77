"""Generation throughput of the vLLM rollout engine on the tiny models, and HF reference scoring
throughput (batched vs one sequence at a time), on this machine.

    .venv/bin/python benchmarks/bench_vllm.py [--prompts 64] [--n 4] [--max-tokens 64] [--dtype float32]

Per arch: build the model (`rlcheck.modelzoo`), start the engine (timed), generate prompts x n
samples of max_tokens (best of --repeat), report generated tokens per second; then score all of them
with `HFScorer.score` (packed or length-bucketed) and with `score_one` per sequence.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="llama,mamba2,hybrid")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from rlcheck.engines.hf import HFScorer, HFScorerConfig
    from rlcheck.engines.vllm import VLLMConfig, VLLMEngine
    from rlcheck.modelzoo import build_model

    print("| arch | dtype | engine start s | samples | generated tokens | gen tok/s | HF batched tok/s | HF one-by-one tok/s | batched speed-up | HF padding |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model = str(build_model(arch, os.path.join(tmp, arch), dtype=args.dtype))
            tok = AutoTokenizer.from_pretrained(model)
            prompts = [tok.encode(f"Q: {i % 97}+{(7 * i) % 89}\nA:") for i in range(args.prompts)]
            t0 = time.perf_counter()
            engine = VLLMEngine(VLLMConfig(model=model, dtype=args.dtype, max_tokens=args.max_tokens,
                                           max_model_len=512, kv_cache_bytes=256 << 20, engine_id=arch))
            start = time.perf_counter() - t0
            best, rollouts = float("inf"), []
            for rep in range(args.repeat):
                t0 = time.perf_counter()
                rollouts = engine.generate(prompts, step=rep, n=args.n)
                best = min(best, time.perf_counter() - t0)
            engine.close()
            gen = sum(len(r.token_ids) for r in rollouts)
            scorer = HFScorer(HFScorerConfig(model=model, dtype=args.dtype))
            ps, rs = [r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts]
            total = sum(len(p) + len(r) for p, r in zip(ps, rs, strict=True))
            t0 = time.perf_counter()
            scorer.score(ps, rs)
            batched = time.perf_counter() - t0
            t0 = time.perf_counter()
            for p, r in zip(ps, rs, strict=True):
                scorer.score_one(p, r)
            single = time.perf_counter() - t0
            print(f"| {arch} | {args.dtype} | {start:.1f} | {len(rollouts)} | {gen} | {gen / best:,.0f} | "
                  f"{total / batched:,.0f} | {total / single:,.0f} | {single / batched:.1f}x | {scorer.last_padding_fraction:.1%} |",
                  flush=True)
            del scorer
            gc.collect()


if __name__ == "__main__":
    main()
