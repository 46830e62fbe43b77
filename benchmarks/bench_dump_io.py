"""Reading a large dump back (`rlcheck.core.run.dump.read_dump`), and what a halt across ranks gathers:
the cost of a step of many tokens on the forensic path.

    .venv/bin/python benchmarks/bench_dump_io.py [--sequences 1000] [--tokens 1000] [--ranks 8]

- read: a dump of `sequences` x `tokens` (logprobs, token ids, mask) written once, read back by
  `read_dump`; wall seconds and the process's peak RSS growth (ru_maxrss) while reading.
- gather: the bytes a halt across `ranks` ranks sends to rank 0 (each rank's pickled share of the step:
  its whole batch before issue 42, its worst sequences, top_k of them, after).
Run it against another tree with PYTHONPATH (the before/after rows of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import pickle
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.run.dump import read_dump, write_dump
from rlcheck.core.stats import StatsConfig, compute_partial


def batch(num: int, length: int, seed: int = 0, prefix: str = "r") -> StepBatch:
    rng = np.random.default_rng(seed)
    lr = -rng.exponential(1.0, num * length)
    lt = np.minimum(lr + rng.normal(0, 0.02, lr.shape), 0.0)
    return StepBatch.from_packed(lr, lt, np.arange(num + 1, dtype=np.int64) * length,
                                 [f"{prefix}{i}" for i in range(num)], tokens=rng.integers(0, 150_000, lr.shape),
                                 mask=rng.random(lr.shape) > 0.05)


def read(num: int, length: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        where = write_dump(Path(tmp) / "step_000000", batch(num, length), step=0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        rows, _ = read_dump(where)
        seconds = time.perf_counter() - t0
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert len(rows) == num and len(rows[-1]["logp_rollout"]) == length
    return {"seconds": seconds, "peak_rss_growth_mb": grown / 1024}


def gather(num: int, length: int, ranks: int, top_k: int = 10) -> dict[str, float]:
    share = batch(num // ranks, length)
    whole = len(pickle.dumps(share)) * ranks
    worst = sorted({o.index for o in compute_partial(share, StatsConfig(top_k=top_k)).offenders})
    selected = len(pickle.dumps(share.select(worst))) * ranks
    return {"whole_batches_mb": whole / 2**20, "worst_sequences_mb": selected / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args()
    print({"read": read(args.sequences, args.tokens), "gather": gather(args.sequences, args.tokens, args.ranks)})


if __name__ == "__main__":
    main()
