"""Environment variables a `VLLMEngine` sets before vLLM starts (vLLM's worker processes inherit them).

- `VLLM_ENABLE_V1_MULTIPROCESSING=0` (unless set): the engine core in this process.
- `VLLM_ALLOW_INSECURE_SERIALIZATION=1` with tensor parallelism: rlcheck's functions (the sync check's
  fingerprint) go pickled to the worker processes.
- `TRITON_F32_DEFAULT=ieee` for a float32 engine on CUDA (unless set): there vLLM's attention runs on its
  Triton backend, whose `tl.dot` computes float32 in TF32 by default (about 1e-3 relative), which
  would put decode and prefill, and the engine and an fp32 HF reference, 1e-3 to 1e-2 nats apart
  against a 1e-3 fp32 threshold. Said in one stderr line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

FP32 = ("float32", "fp32", "float")


def engine_env(dtype: str, tensor_parallel_size: int, cuda: bool | None = None,
               environ: MutableMapping[str, str] = os.environ) -> None:
    """Set what an engine of `dtype` on `tensor_parallel_size` workers needs (`cuda` None: ask torch)."""
    environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if tensor_parallel_size > 1:
        environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if str(dtype) in FP32 and "TRITON_F32_DEFAULT" not in environ and (cuda if cuda is not None else _cuda()):
        environ["TRITON_F32_DEFAULT"] = "ieee"
        print("rlcheck: TRITON_F32_DEFAULT=ieee for a float32 vLLM engine on CUDA (Triton's tl.dot would "
              "compute float32 in TF32)", file=sys.stderr)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
