"""Replay throughput: `rlcheck.forensics.replay` batched (packed rows for Llama, length buckets for the
hybrid) against one sequence per forward pass, on a dump with realistic ragged lengths.

    .venv/bin/python benchmarks/bench_replay.py [--archs llama,hybrid] [--sequences 256] [--repeat 3] [--threads N]
        [--response-median 96] [--max-response 768]

Per arch: build the tiny model (`rlcheck.modelzoo`), write a dump of --sequences sequences (prompts of
16-64 random tokens, responses lognormal with median --response-median tokens, sigma 0.8, clipped
to 4..--max-response; the rollout
logprobs are the reference's own, so the replay is clean), load the HF reference once, then time
`replay(dump, scorer=...)` end to end (dump read, scoring, comparison, ranking) batched and one at a
time, interleaved, best of --repeat. Throughput counts sequences and tokens through the model
(prompt + response). The token ids are random: the reference's cost does not depend on which they are.

`call ms`: the fixed cost of one forward pass (median of `score_one` on a 1-token prompt and a 1-token
response); `bound`: the speed-up batching could reach if it removed every per-call cost and nothing
else, one-at-a-time time / (that time - sequences x call ms).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def make_dump(model_dir: str, out: str, num: int, seed: int, scorer, median: int = 96, longest: int = 768) -> str:
    from rlcheck.core.batch import StepBatch
    from rlcheck.core.run.dump import write_dump

    rng = np.random.default_rng(seed)
    vocab = scorer.model.config.vocab_size
    prompts = [rng.integers(3, vocab, rng.integers(16, 65)).tolist() for _ in range(num)]
    lens = np.clip(rng.lognormal(np.log(median), 0.8, num), 4, longest).astype(int)
    responses = [rng.integers(3, vocab, n).tolist() for n in lens]
    logp = scorer.score(prompts, responses)
    batch = StepBatch.from_ragged(logp_rollout=logp, logp_train=logp, request_ids=[f"bench/{i}" for i in range(num)],
                                  tokens=responses, prompt_tokens=prompts)
    return str(write_dump(out, batch, step=0, context={"model": model_dir}))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def call_seconds(scorer, repeat: int = 50) -> float:
    """Median seconds of a forward pass over 2 tokens: what every pass costs whatever its size."""
    times = [timed(lambda: scorer.score_one([5], [6]))[0] for _ in range(repeat)]
    return float(np.median(times))


def bench_arch(arch: str, args) -> str:
    from rlcheck.engines.hf import HFScorer, HFScorerConfig
    from rlcheck.forensics import replay
    from rlcheck.modelzoo import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(arch, os.path.join(tmp, arch)))
        scorer = HFScorer(HFScorerConfig(model=model))
        dump = make_dump(model, os.path.join(tmp, "dump"), args.sequences, args.seed, scorer,
                         args.response_median, args.max_response)
        best = {True: float("inf"), False: float("inf")}
        reports = {}
        for _ in range(args.repeat):
            for batched in (True, False):
                seconds, reports[batched] = timed(lambda b=batched: replay(dump, model, batch=b, scorer=scorer))
                best[batched] = min(best[batched], seconds)
        call = call_seconds(scorer)
    rb, rs = reports[True], reports[False]
    single = {r.request_id: r.max_abs_diff for r in rs.records}
    agree = max(abs(r.max_abs_diff - single[r.request_id]) for r in rb.records)
    n, tokens = len(rb.records), rb.num_scored_tokens
    longest = max(r.length for r in rb.records)
    bound = best[False] / max(best[False] - n * call, 1e-9)
    return (f"| {arch} | {n} | {tokens:,} | {longest} | {best[True]:.2f} | {n / best[True]:,.0f} | "
            f"{tokens / best[True]:,.0f} | {best[False]:.2f} | {n / best[False]:,.0f} | {tokens / best[False]:,.0f} | "
            f"**{best[False] / best[True]:.2f}x** | {call * 1e3:.2f} | {bound:.2f}x | {rb.padding_fraction:.1%} | {agree:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="llama,hybrid")
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's own]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--response-median", type=int, default=96, help="median response length (lognormal)")
    ap.add_argument("--max-response", type=int, default=768, help="responses are clipped to 4..this")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}, load average at start: {os.getloadavg()[0]:.1f}")
    print("| arch | sequences | tokens | longest response | batched s | batched seq/s | batched tok/s | "
          "one-at-a-time s | one seq/s | one tok/s | speed-up | call ms | bound | padding | max diff batched vs one |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        print(bench_arch(arch, args), flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
