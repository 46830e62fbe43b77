"""MoE routing agreement (issue 29): the healthy floor of a bf16 engine against an fp32 trainer on the
trained tiny MoE, and what `moe-route-flip=P` does to it, on sampling seeds not tuned on.

    .venv/bin/python benchmarks/bench_moe_routing.py [--model runs/models/moe-trained] [--seeds 101 202 303]
        [--prompts 64] [--tokens 32] [--json benchmarks/data/moe_routing.json]

Per case (engine dtype, flip P) one in-process vLLM engine (CPU, eager) with `RouteCapture` on its
routers (flip P > 0: the fault's `RouteFlip` first, so the recorded routing is the one used); per
seed, `--prompts` addition prompts of the loop's task (`AdditionTask(seed=seed)`), one sample each of
`--tokens` tokens (temperature 1, ignore_eos). The trainer side is HF in float32, one teacher-forced
forward per sequence with `RouteRecorder` on its routers. Per (case, seed): route_agree_frac, the
per-layer agreement, mean |d|, the share of sum |d| on rerouted tokens and the lift, and whether the
`moe_routing` rule's condition holds (`rlcheck.forensics.diagnose.rules.moe`: share >= 0.5 and >= 2 x the
rerouted share of tokens), and whether agree_frac is below the healthy floor (the lowest healthy
agree_frac of the same engine dtype over all seeds).

    .venv/bin/python benchmarks/bench_moe_routing.py --table-only   # re-read the --json file
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import numpy as np

CASES = (("float32", 0.0), ("bfloat16", 0.0), ("float32", 0.05), ("float32", 0.2), ("float32", 0.5),
         ("bfloat16", 0.05), ("bfloat16", 0.2), ("bfloat16", 0.5))


def trainer_side(model, prompt: list[int], completion: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logprobs (T,), experts (T, L, k)) of one fp32 HF forward over prompt + completion."""
    import torch

    from rlcheck.engines.moe_routing import response_rows
    from rlcheck.trainers.moe_routing import RouteRecorder

    ids = torch.tensor([prompt + completion])
    with RouteRecorder(model) as routes, torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)[len(prompt) - 1 : -1]
    lp = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()
    return lp, response_rows(routes.experts(), np.arange(ids.shape[1]), len(prompt), len(completion))


def run_case(path: Path, dtype: str, flip: float, seeds: list[int], args, model, tok) -> list[dict]:
    import vllm

    from rlcheck.core.moe import CONCENTRATION, MIN_SHARE, Routing, routing_stats
    from rlcheck.engines.moe_capture import RouteCapture
    from rlcheck.loop.task import AdditionTask, encode_prompts
    from rlcheck.modelzoo import vllm_cpu_kwargs

    llm = vllm.LLM(model=str(path), **vllm_cpu_kwargs(dtype=dtype, max_model_len=256))
    rows = []
    try:
        with RouteCapture(llm, flip=flip, seed=1) as capture:
            for seed in seeds:
                task = AdditionTask(num_prompts=args.prompts, seed=seed)
                prompts = encode_prompts(tok, [t for t, _ in task.prompts(0)])
                params = vllm.SamplingParams(max_tokens=args.tokens, temperature=1.0, logprobs=0, seed=seed,
                                             ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                eng_e, tr_e, diffs = [], [], []
                for o in outs:
                    done, prompt = o.outputs[0], list(o.prompt_token_ids)
                    lp = np.array([d[t].logprob for d, t in zip(done.logprobs, done.token_ids, strict=True)])
                    eng_e.append(capture.response_experts(o.request_id, len(prompt), len(done.token_ids)))
                    hf_lp, hf_e = trainer_side(model, prompt, list(done.token_ids))
                    tr_e.append(hf_e)
                    diffs.append(hf_lp - lp)
                capture.clear()
                d = np.concatenate(diffs)
                s = routing_stats(Routing.from_sequences(eng_e, tr_e), d)
                moved = 1.0 - s.agree_frac
                rows.append({"dtype": dtype, "flip": flip, "seed": seed, "tokens": s.num_tokens,
                             "agree_frac": s.agree_frac, "layer_agree": s.layer_agree_frac,
                             "abs_diff_mean": float(np.abs(d).mean()), "share": s.abs_diff_share,
                             "lift": s.abs_diff_lift,
                             "rule": bool(moved > 0 and s.abs_diff_share >= max(MIN_SHARE, CONCENTRATION * moved))})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        del llm
        gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    floor = {dt: min(r["agree_frac"] for r in rows if r["dtype"] == dt and r["flip"] == 0) for dt in {"float32", "bfloat16"}
             if any(r["dtype"] == dt and r["flip"] == 0 for r in rows)}
    out = ["| engine | flip P | seed | tokens | route_agree_frac | layer 0 / 1 | mean abs d | share of sum abs d rerouted | lift | rule | below floor |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        below = r["agree_frac"] < floor.get(r["dtype"], 1.0)
        layers = " / ".join(f"{x:.4f}" for x in r["layer_agree"])
        out.append(f"| {r['dtype']} | {r['flip']:g} | {r['seed']} | {r['tokens']} | {r['agree_frac']:.4f} | {layers} | "
                   f"{r['abs_diff_mean']:.3g} | {r['share']:.3f} | {r['lift']:.3g} | {r['rule']} | "
                   f"{'-' if r['flip'] == 0 else below} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runs/models/moe-trained")
    p.add_argument("--seeds", type=int, nargs="+", default=[101, 202, 303])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", default="benchmarks/data/moe_routing.json")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    if args.table_only:
        return print(table(json.loads(Path(args.json).read_text())))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import transformers

    from rlcheck.modelzoo import ensure_trained

    torch.set_num_threads(1)
    path = ensure_trained(args.model, "moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    rows = [r for dtype, flip in CASES for r in run_case(path, dtype, flip, args.seeds, args, model, tok)]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
