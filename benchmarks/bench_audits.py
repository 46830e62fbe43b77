"""The engine self-audits on the real vLLM CPU engine: what decode vs prefill finds without a reference,
how batch-invariant the tiny models are, and how that changes with max_num_seqs.

    .venv/bin/python benchmarks/bench_audits.py [--part decode,invariance,sweep] [--requests 128]
        [--seeds 0,1] [--held-out 2,3] [--out benchmarks/data/audits.json] [--plot docs/batch-invariance-sweep.png]

- decode: per Mamba arch (mamba2, hybrid) and dtype (float32, bfloat16), per seed, runs without a fault,
  with stale-state and with index-wrap: `rlcheck stress --audit decode-prefill` with the HF reference,
  the failing requests of each (same set?), and a clean `--no-reference` run of 2,000 requests (the
  floor of decode vs prefill at scale). llama (no state) clean only. Thresholds: stress's own (1e-3
  float32, 0.5 bfloat16), calibrated on --seeds and checked on --held-out.
- invariance: per arch (llama, mamba2, hybrid) and dtype, `--audit batch-invariance --no-reference`:
  requests differing between max_num_seqs 64, 1 and 64 shuffled; distinct outputs; max |d| before the
  first differing token.
- sweep: `rlcheck sweep --audit batch-invariance --knob max_num_seqs=1,2,4,8,16,32,64` on the hybrid in
  bfloat16, no reference (the plot).
Models are built with `rlcheck.modelzoo` (random weights, seed 0) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

DTYPES = ("float32", "bfloat16")


def decode_rows(models: dict[str, str], args) -> list[dict]:
    from rlcheck.forensics.replay import load_scorer
    from rlcheck.forensics.stress import StressConfig, run_stress

    rows = []
    for arch in ("mamba2", "hybrid", "llama"):
        scorer = load_scorer(models[arch])
        faults = ("none", "stale-state", "index-wrap") if arch != "llama" else ("none",)
        for dtype in DTYPES:
            for split, seeds in (("calibration", args.seeds), ("held-out", args.held_out)):
                for seed in seeds:
                    for fault in faults:
                        cfg = StressConfig(model=models[arch], num_requests=args.requests, dtype=dtype, seed=seed,
                                           fault=fault, audits=("decode-prefill",))
                        r = run_stress(cfg, scorer=scorer)
                        dp = r.audits["decode_prefill"]
                        rows.append({"arch": arch, "dtype": dtype, "split": split, "seed": seed, "fault": fault,
                                     "requests": r.num_requests, "threshold": r.threshold,
                                     "reference_failing": len(r.failing), "audit_failing": len(dp.failing),
                                     "same_requests": set(r.failing_request_ids) == set(dp.failing_request_ids),
                                     "audit_max_abs_diff": max(dp.max_abs_diff), "audit_seconds": dp.seconds,
                                     "reference_seconds": r.seconds.get("score")})
                        print(json.dumps(rows[-1]), flush=True)
            cfg = StressConfig(model=models[arch], num_requests=2000, dtype=dtype, seed=args.held_out[0],
                               audits=("decode-prefill",), reference=False)
            r = run_stress(cfg)
            dp = r.audits["decode_prefill"]
            rows.append({"arch": arch, "dtype": dtype, "split": "held-out", "seed": cfg.seed, "fault": "none",
                         "requests": 2000, "threshold": r.threshold, "reference_failing": None,
                         "audit_failing": len(dp.failing), "same_requests": None,
                         "audit_max_abs_diff": max(dp.max_abs_diff), "audit_seconds": dp.seconds,
                         "reference_seconds": None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def invariance_rows(models: dict[str, str], args) -> list[dict]:
    from rlcheck.forensics.stress import StressConfig, run_stress

    rows = []
    for arch in ("llama", "mamba2", "hybrid"):
        for dtype in DTYPES:
            cfg = StressConfig(model=models[arch], num_requests=args.requests, dtype=dtype, seed=args.held_out[0],
                               audits=("batch-invariance",), reference=False)
            bi = run_stress(cfg).audits["batch_invariance"]
            d = bi.to_dict()
            rows.append({"arch": arch, "dtype": dtype, "requests": d["num_requests"], "runs": d["runs"],
                         "requests_differing": d["requests_differing"],
                         "requests_tokens_differing": d["requests_tokens_differing"],
                         "distinct_outputs": d["distinct_outputs"], "max_abs_diff": d["max_abs_diff"],
                         "seconds": d["seconds"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep_points(models: dict[str, str], args) -> list[dict]:
    from dataclasses import asdict

    from rlcheck.forensics.stress import StressConfig
    from rlcheck.forensics.stress.report import plot_sweep
    from rlcheck.forensics.sweep import parse_knob, run_sweep

    base = StressConfig(model=models["hybrid"], num_requests=args.requests, dtype="bfloat16", seed=args.held_out[0],
                        audits=("batch-invariance",), reference=False)
    result = run_sweep(base, [parse_knob("max_num_seqs=1,2,4,8,16,32,64")])
    if args.plot:
        shown = replace(result, base=replace(base, model="hybrid"))
        plot_sweep(shown, __import__("pathlib").Path(args.plot))
    points = [{k: v for k, v in asdict(p).items() if k != "failing_request_ids"} for p in result.points]
    for p in points:
        print(json.dumps(p), flush=True)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="decode,invariance,sweep")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--seeds", default="0,1", help="calibration seeds")
    ap.add_argument("--held-out", default="2,3", help="seeds not looked at while setting thresholds")
    ap.add_argument("--out", default="benchmarks/data/audits.json")
    ap.add_argument("--plot", default="docs/batch-invariance-sweep.png")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.held_out = [int(s) for s in args.held_out.split(",")]
    from rlcheck.modelzoo import build_model

    parts = args.part.split(",")
    out = json.load(open(args.out)) if os.path.exists(args.out) else {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {arch: str(build_model(arch, os.path.join(tmp, arch))) for arch in ("llama", "mamba2", "hybrid")}
        for part, fn in (("decode", decode_rows), ("invariance", invariance_rows), ("sweep", sweep_points)):
            if part in parts:
                out[part] = fn(models, args)
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
