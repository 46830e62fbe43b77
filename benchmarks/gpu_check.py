"""The GPU path's device check: one script for one CUDA machine with torch, transformers, triton, numpy
(no vLLM, no Ray, no network). Each check prints one PASS / FAIL / SKIP line with its figures, and
OUT/gpu_check.json gets them all.

    python benchmarks/gpu_check.py                 # on the device (about 3-5 minutes on one H200)
    python benchmarks/gpu_check.py --smoke         # the same checks at tiny sizes on CPU (make test runs it)
    make gpu-check

Checks (what the CPU tests cannot answer):
- env: torch, CUDA, the device, triton, transformers.
- triton_dot: a Triton float32 `tl.dot` with the default precision (TF32 on NVIDIA) and with
  `input_precision="ieee"`, against float64; then the default again under `TRITON_F32_DEFAULT=ieee`
  (what rlcheck sets for float32 vLLM engines, `rlcheck.engines.vllm_env`), which must match ieee.
- token_logprobs: `chunked_token_logprobs` against naive log_softmax + gather at N x H x V (8192 x 896 x
  151936 on the device), bf16 and fp32, forward and backward: max |d|, gradients, peak memory.
- stats: the statistics of one 16M-token step (200k with --smoke) from device tensors, numpy vs torch
  eager vs torch compiled: the same metrics, the time of each.
- fingerprint: the sync check's sums of an embedding-sized bf16 tensor (151936 x 896): equal to float64
  sums of the whole, peak memory beyond the tensor under a float64 copy's size (chunked).
- hf_device: the tiny llama, mamba2 and hybrid in HF float32 on the device against the CPU: max |d|.
- fsdp2: `rlcheck.trainers.backends.FSDP2Backend` at world size 1 on a random tied Qwen2 of 0.5B shape
  (fp32 masters, bf16 compute): logprobs against an unsharded bf16 copy; the synced weights (cast on
  the device, gathered, pinned) equal to the bf16 model, the tied weight gathered once, their time
  against a float32 gather cast on the host, and the host syncs; a micro-batch's logprobs to the host
  in one copy; the trainer's fingerprint equal to a fresh copy's.
- sync_group: the collective weight sync's own group (`rlcheck.engines.vllm_collective.SyncGroup`) on
  NCCL at world size 1 (gloo with --smoke): layout and buckets through rlcheck's send code, GB/s.
- gloo: a 1 GiB broadcast between two processes over gloo (the collective weight sync's transport),
  pinned and pageable host memory: GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _device(smoke: bool) -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() and not smoke else torch.device("cpu")


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def _host_syncs(device: torch.device, fn):
    """(fn's result, how many times it made the host wait for the GPU: torch's sync debug mode warns
    at each; None on CPU)."""
    if device.type != "cuda":
        return fn(), None
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchronizing" in str(w.message) for w in seen)


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def check_env(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    figures = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(dev),
               "name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "triton": triton_version, "transformers": transformers.__version__}
    return ("PASS" if dev.type == "cuda" or smoke else "FAIL"), figures


_TRITON_KERNEL = '''
import torch, triton, triton.language as tl, sys
@triton.jit
def dot(a, b, c, N: tl.constexpr, IEEE: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(a + i[:, None] * N + i[None, :])
    y = tl.load(b + i[:, None] * N + i[None, :])
    z = tl.dot(x, y, input_precision="ieee") if IEEE else tl.dot(x, y)
    tl.store(c + i[:, None] * N + i[None, :], z)
g = torch.Generator().manual_seed(0)
a, b = (torch.randn(64, 64, generator=g) for _ in range(2))
ref = (a.double() @ b.double())
out = {}
for ieee in (False, True):
    c = torch.empty(64, 64, device="cuda")
    dot[(1,)](a.cuda(), b.cuda(), c, N=64, IEEE=ieee)
    out["ieee" if ieee else "default"] = float(((c.double().cpu() - ref).abs().max() / ref.abs().max()))
print(out)
'''


def check_triton_dot(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    if dev.type != "cuda":
        return "SKIP", {"why": "no CUDA: Triton's float32 dot precision is a GPU question"}
    import ast
    import subprocess

    runs = {}
    for name, env in (("as is", {}), ("TRITON_F32_DEFAULT=ieee", {"TRITON_F32_DEFAULT": "ieee"})):
        done = subprocess.run([sys.executable, "-c", _TRITON_KERNEL], capture_output=True, text=True,
                              env={**{k: v for k, v in os.environ.items() if k != "TRITON_F32_DEFAULT"}, **env},
                              timeout=300)
        if done.returncode:
            return "FAIL", {"error": done.stderr[-500:]}
        runs[name] = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    fixed = runs["TRITON_F32_DEFAULT=ieee"]
    ok = runs["as is"]["ieee"] < 1e-5 and fixed["default"] < 1e-5
    return ("PASS" if ok else "FAIL"), {"relative error": runs}


def check_token_logprobs(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    from rlcheck.trainers.chunked_logprobs import chunked_token_logprobs

    n, h, v = (256, 64, 4096) if smoke else (8192, 896, 151936)
    figures, ok = {}, True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        g = torch.Generator(device="cpu").manual_seed(0)
        hidden = (torch.randn(n, h, generator=g) * 0.5).to(dev, dtype).requires_grad_()
        weight = (torch.randn(v, h, generator=g) * 0.05).to(dev, dtype).requires_grad_()
        targets = torch.randint(0, v, (n,), generator=g).to(dev)
        out = {}
        for method in ("naive", "rlcheck"):
            hidden.grad = weight.grad = None
            _reset(dev)
            t0 = time.perf_counter()
            if method == "naive":
                logp = (hidden @ weight.T).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
            else:
                logp = chunked_token_logprobs(hidden, weight, targets).logp
            logp.sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out[method] = (logp.detach().float(), hidden.grad.float(), weight.grad.float(),
                           time.perf_counter() - t0, _peak(dev))
        d = float((out["naive"][0] - out["rlcheck"][0]).abs().max())
        grad = max(float((out["naive"][i] - out["rlcheck"][i]).abs().max() / out["naive"][i].abs().max().clamp(min=1e-30))
                   for i in (1, 2))
        ok &= d <= tol and grad <= 10 * tol
        figures[str(dtype).removeprefix("torch.")] = {
            "max |d|": d, "grad rel": grad, "seconds naive / rlcheck": [out["naive"][3], out["rlcheck"][3]],
            "peak MiB naive / rlcheck": [out["naive"][4], out["rlcheck"][4]]}
    return ("PASS" if ok else "FAIL"), {"N x H x V": [n, h, v], **figures}


def check_stats(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    from benchmarks.bench_stats import make_step
    from rlcheck.core.batch import StepBatch
    from rlcheck.core.stats import StatsConfig, compute

    tokens, seqs = (200_000, 200) if smoke else (16_000_000, 16_000)
    lr, lt, cu = make_step(tokens, seqs, 0.3)
    ids = [f"r{i}" for i in range(seqs)]
    batch = StepBatch.from_packed(torch.from_numpy(lr).to(dev), torch.from_numpy(lt).to(dev), cu, ids)
    backends = ("numpy", "torch-eager") + (() if smoke else ("torch",))
    got, seconds = {}, {}
    syncs = {}
    for name in backends:
        compute(batch, StatsConfig(backend=name))  # warm-up (the compiled one compiles here)
        t0 = time.perf_counter()
        (got[name], _), syncs[name] = _host_syncs(dev, lambda name=name: compute(batch, StatsConfig(backend=name)))
        seconds[name] = time.perf_counter() - t0
    ref = got["numpy"]
    worst = max(abs(got[b][k] - v) / max(abs(v), 1e-12) for b in backends for k, v in ref.items()
                if isinstance(v, float) and np.isfinite(v))
    return ("PASS" if worst < 1e-4 else "FAIL"), {"tokens": tokens, "device": str(dev), "seconds by backend": seconds,
                                                   "host syncs by backend": syncs, "worst relative difference": worst}


def check_fingerprint(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    from rlcheck.engines.fingerprint import add_stats

    rows, cols = (4096, 64) if smoke else (151936, 896)
    t = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(dev, torch.bfloat16)
    _reset(dev)
    base = torch.cuda.memory_allocated() / 2**20 if dev.type == "cuda" else None
    fp: dict = {}
    add_stats(fp, "embed:params", t)
    peak = _peak(dev)
    whole = t.double()
    want = [float(whole.sum()), float((whole * whole).sum()), float(whole.abs().sum())]
    err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(fp["embed:params"][:3], want, strict=True))
    extra = None if peak is None else peak - base
    f64 = t.numel() * 8 / 2**20
    ok = err < 1e-12 and (extra is None or extra < f64 / 2)
    return ("PASS" if ok else "FAIL"), {"shape": [rows, cols], "relative error": err,
                                        "peak MiB beyond the tensor": extra, "a float64 copy, MiB": f64}


def check_hf_device(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    from transformers import AutoModelForCausalLM

    from rlcheck.modelzoo import build_model

    figures, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "mamba2", "hybrid"):
            path = build_model(arch, Path(tmp) / arch)
            ids = torch.randint(3, 200, (2, 48), generator=torch.Generator().manual_seed(1))
            logp = {}
            for where in ("cpu", dev.type):
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(where).eval()
                with torch.no_grad():
                    logits = model(input_ids=ids.to(where)).logits.float().log_softmax(-1)
                logp[where] = logits[:, :-1].gather(-1, ids[:, 1:, None].to(where)).squeeze(-1).cpu()
            d = float((logp["cpu"] - logp[dev.type]).abs().max())
            ok &= d < 1e-4
            figures[arch] = d
    return ("PASS" if ok else "FAIL"), {"max |d| device vs cpu": figures}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_fsdp2(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcheck.core.sync_check import differing_keys
    from rlcheck.trainers.backends import FSDP2Backend
    from rlcheck.trainers.config import TrainerConfig
    from rlcheck.trainers.fingerprint import module_fingerprint
    from rlcheck.trainers.logprobs import token_logprobs
    from rlcheck.trainers.policy import _to_host

    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1024) if smoke else
             dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936))
    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=512)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).to(dev)
        plain = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        plain.load_state_dict(model.state_dict())
        plain.to(dev).eval()
        # rlcheck's FSDP2 trainer: float32 masters, bf16 compute, bf16 synced weights
        backend = FSDP2Backend(TrainerConfig(model="-", backend="fsdp2", dtype="bfloat16", device=dev.type), model)
        ids = torch.randint(3, cfg.vocab_size, (4, 128 if not smoke else 32), generator=torch.Generator().manual_seed(2))
        ids = ids.to(dev)
        with torch.no_grad():
            sharded = token_logprobs(backend.module, ids).logp.float()
            ref = token_logprobs(plain, ids).logp.float()
        t0 = time.perf_counter()
        old = {n: t.to(torch.bfloat16) for n, t in get_model_state_dict(
            backend.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()}
        old_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        synced, syncs = _host_syncs(dev, backend.full_state_dict)
        new_s = time.perf_counter() - t0
        synced = dict(synced)
        want = {n: t.cpu() for n, t in plain.state_dict().items()}
        keys_ok = synced.keys() == want.keys() == old.keys()
        exact = keys_ok and all(torch.equal(synced[n], want[n]) for n in want)
        tied_once = synced["lm_head.weight"] is synced["model.embed_tokens.weight"]
        pinned = dev.type != "cuda" or all(t.is_pinned() for t in synced.values())
        # the trainer's logprobs of a micro-batch of 64 sequences to the host: one copy, not 64
        parts = [(sharded[0, : 16 + i % 8],) for i in range(64)]
        _, copy_syncs = _host_syncs(dev, lambda: _to_host(parts))
        mine = module_fingerprint(backend.module, torch.bfloat16, sharding="fsdp2", rank=0, world_size=1)
        differ = differing_keys(mine, module_fingerprint(plain, torch.bfloat16))
        d = float((sharded - ref).abs().mean())
        ok = d < 0.05 and exact and tied_once and pinned and differ == [] and copy_syncs in (None, 1)
        return ("PASS" if ok else "FAIL"), {
            "params": sum(p.numel() for p in plain.parameters()), "mean |d| sharded vs plain": d,
            "synced weights equal the bf16 model": exact, "tied weight gathered once": tied_once, "pinned": pinned,
            "full_state_dict s (rlcheck / fp32 gather then cast)": [new_s, old_s], "full_state_dict host syncs": syncs,
            "64 sequences' logprobs to host, host syncs": copy_syncs, "fingerprint differs": differ}
    finally:
        dist.destroy_process_group()


def check_sync_group(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    """The collective weight sync's group on this device's backend (NCCL on CUDA, gloo on CPU) at world
    size 1 (one GPU: NCCL takes one rank a device): the layout and the buckets through rlcheck's own
    send code, from pinned host memory into the group's device buffers."""
    from rlcheck.engines.vllm_collective import SyncGroup, send_weights

    backend = "nccl" if dev.type == "cuda" else "gloo"
    group = SyncGroup("127.0.0.1", _free_port(), 0, 1, 60.0, backend)
    g = torch.Generator().manual_seed(0)
    n = 1 << 16 if smoke else 1 << 26
    weights = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(n // 64, 64, generator=g).bfloat16()) for i in range(8)]
    if dev.type == "cuda":
        weights = [(name, t.pin_memory()) for name, t in weights]
    t0 = time.perf_counter()
    sent = send_weights(group, weights, bucket_bytes=n)  # world size 1: into the group's buffers, a broadcast to itself
    seconds = time.perf_counter() - t0
    ok = sent["bytes"] == sum(t.numel() * 2 for _, t in weights) and sent["buckets"] >= 2 and group.device.type == dev.type
    return ("PASS" if ok else "FAIL"), {"backend": backend, "bytes": sent["bytes"], "buckets": sent["buckets"],
                                        "GB/s host to group": sent["bytes"] / seconds / 1e9, "buffers on": str(group.device)}


def _gloo_rank(rank: int, port: int, size: int, pinned: bool, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(size, dtype=torch.uint8) if rank == 0 else torch.empty(size, dtype=torch.uint8)
    if pinned and torch.cuda.is_available():
        t = t.pin_memory()
    dist.broadcast(t, src=0)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(t, src=0)
    dist.barrier()
    if rank == 1:
        Path(out).write_text(json.dumps({"seconds": time.perf_counter() - t0, "ok": bool(t[-1] == 1)}))
    dist.destroy_process_group()


def check_gloo(dev: torch.device, smoke: bool) -> tuple[str, dict]:
    import torch.multiprocessing as mp

    size = (16 << 20) if smoke else (1 << 30)
    figures, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for pinned in (False, True):
            out = os.path.join(tmp, f"{pinned}.json")
            mp.spawn(_gloo_rank, args=(_free_port(), size, pinned, out), nprocs=2, join=True)
            got = json.loads(Path(out).read_text())
            ok &= got["ok"]
            figures["pinned" if pinned else "pageable"] = {"GB/s": size / got["seconds"] / 1e9}
    return ("PASS" if ok else "FAIL"), {"bytes": size, **figures}


CHECKS = {"env": check_env, "triton_dot": check_triton_dot, "token_logprobs": check_token_logprobs,
          "stats": check_stats, "fingerprint": check_fingerprint, "hf_device": check_hf_device,
          "fsdp2": check_fsdp2, "sync_group": check_sync_group, "gloo": check_gloo}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (what make test runs)")
    ap.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="where gpu_check.json goes")
    args = ap.parse_args(argv)
    dev = _device(args.smoke)
    results, t_all = {}, time.perf_counter()
    for name in args.only or CHECKS:
        t0 = time.perf_counter()
        try:
            status, figures = CHECKS[name](dev, args.smoke)
        except Exception as exc:  # a check that breaks is a FAIL with its error; the others still run
            status, figures = "FAIL", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-800:]}
        figures["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = {"status": status, **figures}
        shown = {k: v for k, v in figures.items() if k != "trace"}
        print(f"{status} {name}: {json.dumps(shown, default=str)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    failed = [n for n, r in results.items() if r["status"] == "FAIL"]
    print(f"{'FAIL' if failed else 'PASS'} all: {len(results)} checks in {time.perf_counter() - t_all:.0f} s"
          + (f", failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
