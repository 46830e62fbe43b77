"""Memory and time at a real vocabulary (151,936, Qwen2.5's) and 32k-token sequences, on CPU with random
weights: what chooses the chunked kernel's defaults and shows the HF reference's logits bound.

    .venv/bin/python benchmarks/bench_real_vocab.py chunk    # kernel fwd+bwd vs rows per chunk (nothing kept)
    .venv/bin/python benchmarks/bench_real_vocab.py keep     # kernel fwd+bwd vs bytes of logits kept
    .venv/bin/python benchmarks/bench_real_vocab.py kernel32k --chunk-rows 441 --keep-limit 1073741824
    .venv/bin/python benchmarks/bench_real_vocab.py reference --tokens 2048 4096 8192 32768

What is measured (no whole 7B runs here): `chunk`, `keep`, `kernel32k`: `chunked_token_logprobs` forward
+ backward on a real-shaped LM head, weight (151,936, 3,584) in bfloat16 (Qwen2.5-7B's head), hidden
states (N, 3,584) bfloat16, random targets. `reference`: `HFScorer.score` of one sequence (a 1,024-token
prompt, the rest response) through a random Qwen2-shaped model with that head and no decoder layer
(embeddings, final norm, head: the logits are what is measured), bfloat16, `--paths`: `chunked` (the
reference now), `full` (the model's own forward, all positions' logits, the log-softmax still chunked) or
`before` (the reference before issue 43: that forward, then one float32 log-softmax of every response row).
Every case runs in its own subprocess; peak = the RSS high-water mark (VmHWM, reset through
/proc/self/clear_refs after the inputs exist) minus the RSS then; time is CPU seconds
(`time.process_time`, both cores; other jobs share the machine, so wall time is given but moves).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

from bench_logprobs import _peak_rss, _reset_peak_rss  # noqa: E402 (a sibling script: the RSS high-water mark)

VOCAB, HIDDEN, PROMPT = 151_936, 3_584, 1_024


def kernel_case(tokens: int, chunk_rows: int, keep_bytes: float, keep_limit: float) -> dict:
    """One forward + backward of the chunked kernel on the real-shaped head (see the module docstring)."""
    import torch

    from rlcheck.trainers.chunked_logprobs import chunked_token_logprobs

    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5).to(torch.bfloat16).requires_grad_()
    hidden = torch.randn(tokens, HIDDEN).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,))
    chunked_token_logprobs(hidden[:8].detach(), weight.detach(), targets[:8], chunk_size=4)  # warm-up
    base = _reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    out = chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk_rows, keep_bytes=keep_bytes,
                                 keep_limit=keep_limit)
    t1, c1 = time.perf_counter(), time.process_time()
    out.logp.sum().backward()
    num_chunks = -(-tokens // chunk_rows)
    kept = min(num_chunks, math.floor(keep_bytes / 2 * num_chunks + 1e-9),
               num_chunks if math.isinf(keep_limit) else math.floor(keep_limit / (chunk_rows * VOCAB * 2)))
    return {"fwd_cpu_s": c1 - c0, "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
            "fwd_wall_s": t1 - t0, "peak_mib": (_peak_rss() - base) / 2**20, "chunks": num_chunks, "kept": kept}


def reference_case(tokens: int, path: str) -> dict:
    """`HFScorer.score` of one `tokens`-long sequence (1,024 prompt tokens) on the head-only model."""
    import numpy as np
    import torch
    import transformers

    from rlcheck.engines.hf import HFScorer, HFScorerConfig

    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=0,
                                   num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=40_000,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    scorer = HFScorer(HFScorerConfig(model="in-process", dtype="bfloat16"), model=model)
    if path in ("full", "before"):
        scorer.split = None  # the model's own forward: every position's logits
    if path == "before":  # and the reference before issue 43: one float32 log-softmax of every response row
        def gather(logits, seq, prompt_len, temperature):
            rows = logits[prompt_len - 1 : len(seq) - 1].float() / temperature  # (R, V)
            targets = torch.tensor(seq[prompt_len:], dtype=torch.long)
            return torch.log_softmax(rows, dim=-1).gather(-1, targets[:, None])[:, 0].numpy()

        scorer._gather = gather
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, tokens).tolist()
    base = _reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    scorer.score([ids[:PROMPT]], [ids[PROMPT:]])
    return {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
            "peak_mib": (_peak_rss() - base) / 2**20}


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"rc {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kernel_row(tokens: int, rows: int, keep_bytes: float, keep_limit: float) -> None:
    r = _run(["kernel", str(tokens), str(rows), str(keep_bytes), str(keep_limit)])
    if "error" in r:
        print(f"| {tokens} | {rows} | {keep_bytes:g} | {keep_limit:g} | error: {r['error']} |", flush=True)
        return
    per_k = 1000 * r["cpu_s"] / tokens
    print(f"| {tokens} | {rows} | {r['chunks']} | {keep_bytes:g} | {keep_limit / 2**20:g} MiB | {r['kept']} | "
          f"{r['fwd_cpu_s']:.1f} | {r['cpu_s']:.1f} | {per_k:.2f} | {r['wall_s']:.1f} | {r['peak_mib']:.0f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="?", choices=("chunk", "keep", "kernel32k", "reference"))
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--chunk-rows", type=int, nargs="+", default=[32, 64, 110, 256, 441, 1024, 2048])
    p.add_argument("--keep-limit", type=float, nargs="+", default=[0, 256 * 2**20, 2**30, 2 * 2**30, math.inf])
    p.add_argument("--paths", nargs="+", default=["chunked", "full"])
    p.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        kind, *rest = a.case
        if kind == "kernel":
            print(json.dumps(kernel_case(int(rest[0]), int(rest[1]), float(rest[2]), float(rest[3]))))
        else:
            print(json.dumps(reference_case(int(rest[0]), rest[1])))
        return
    head = ("| tokens | rows/chunk | chunks | keep_bytes | keep_limit | kept | fwd cpu s | fwd+bwd cpu s "
            "| cpu s / 1k tokens | wall s | peak MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    if a.what == "chunk":
        print(head)
        for rows in a.chunk_rows:
            _kernel_row((a.tokens or [4096])[0], rows, 0.0, 0.0)
    elif a.what == "keep":
        print(head)
        for limit in a.keep_limit:
            _kernel_row((a.tokens or [4096])[0], a.chunk_rows[0], 2.0, limit)
    elif a.what == "kernel32k":
        print(head)
        for limit in a.keep_limit:
            _kernel_row((a.tokens or [32768])[0], a.chunk_rows[0], 2.0, limit)
    else:
        print("| tokens | path | cpu s | wall s | peak MiB | peak bytes / token |\n|---|---|---|---|---|---|")
        for tokens in a.tokens or [2048, 4096, 8192, 32768]:
            for path in a.paths:
                r = _run(["reference", str(tokens), path])
                if "error" in r:
                    print(f"| {tokens} | {path} | error: {r['error']} | | | |", flush=True)
                    continue
                print(f"| {tokens} | {path} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['peak_mib']:.0f} | "
                      f"{r['peak_mib'] * 2**20 / tokens:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
