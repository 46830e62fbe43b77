"""Which implementation of `compute_partial` runs: numpy (`partial`) or torch (`torch_partial`).

    StatsConfig.backend   "auto" (default), "numpy", "torch" or "torch-eager"
    RLCHECK_STATS_BACKEND the same values; read when the config says "auto" (tests, the benchmark)

"auto" runs eager torch on a batch that holds device tensors (`StepBatch.device_tensors`: built
from GPU tensors, read where they are), and numpy on every host batch (BENCHMARKS.md, "Statistics on
the tensors' device", 2-core CPU): eager torch is 1.2-1.5x slower than numpy at 4M-16M tokens and
~3x slower on the demo loop's 1.5K-token step, where per-op overhead dominates; compiled torch is
1.4-1.6x faster at 4M-16M tokens, but its first call compiles for 10-40 s, so it is asked for, not
assumed. "torch" / "torch-eager" run torch on a host batch too (read zero-copy); "torch" compiles
the token pass with torch.compile once per process (the common batches only) and falls back to
eager torch when compilation is unavailable or fails. torch is imported by the torch path only, on its first batch, never at import time.
"""

from __future__ import annotations

import os

from rlcheck.errors import ConfigError

BACKENDS = ("auto", "numpy", "torch", "torch-eager")
ENV = "RLCHECK_STATS_BACKEND"


def holds_torch(batch) -> bool:
    """Whether the batch carries torch tensors on a device (`StepBatch.device_tensors`)."""
    return getattr(batch, "device_tensors", None) is not None


def choose(batch, backend: str) -> str:
    """"numpy", "torch" (compiled where it can be) or "torch-eager" for this batch ("numpy" on a batch
    with device tensors reads its numpy fields, the host copy)."""
    if backend == "auto":
        backend = os.environ.get(ENV, "auto") or "auto"
        if backend not in BACKENDS:
            raise ConfigError(f"{ENV}={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "torch-eager" if holds_torch(batch) else "numpy"
