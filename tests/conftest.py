"""Shared fixtures: a realistic, awkward step batch for the statistics and reduction tests."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch


def skewed_batch(
    dtype=np.float64, num_sequences: int = 300, seed: int = 0, extreme: bool = True
) -> StepBatch:
    """A batch with what real steps throw at the statistics, placed so that a split into halves
    (rank 0: first half, rank 1: second half) gives the halves different code paths:

    - heavy-tailed lengths (lognormal) with a few zero-length sequences;
    - mask holes (tool-output spans masked out) and one sequence masked out entirely;
    - first half: an early, catastrophic divergence (d ~ +3 on its first quarter of tokens, at least 4)
      and a d ~ -12 token;
    - second half: one non-finite (NaN) train logprob and, if `extreme`, one token with d = +65
      (past the ratio cap; |d| > 20 switches that half to float64; it dominates every ratio metric).
    """
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(4.5, 1.2, num_sequences), 4000).astype(np.int64)  # (N,)
    lens[rng.choice(num_sequences, 8, replace=False)] = 0
    half = num_sequences // 2
    early, clipped, nan_seq, masked_seq = 17, half + 60, half + 100, half + 7
    negative = int(np.argmax(lens[:half]))
    special = [early, clipped, nan_seq, masked_seq]
    lens[special] = np.maximum(lens[special], 40)
    cu = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])

    lr = -rng.exponential(1.5, num_tokens)  # (M,)
    lt = np.minimum(lr + rng.normal(0.0, 1e-3, num_tokens), 0.0)  # (M,)
    mask = np.ones(num_tokens, dtype=bool)
    for i in rng.choice(num_sequences, num_sequences // 5, replace=False):
        if lens[i] >= 10:  # a tool-output span inside the response
            a = cu[i] + rng.integers(1, lens[i] // 2)
            mask[a : a + rng.integers(1, lens[i] // 2)] = False
    mask[cu[masked_seq] : cu[masked_seq + 1]] = False

    def at(seq: int, pos: int) -> int:
        mask[cu[seq] + pos] = True
        return int(cu[seq] + pos)

    for p in range(max(4, int(lens[early]) // 4)):
        lr[at(early, p)], lt[at(early, p)] = -8.0, -5.0
    t = at(negative, lens[negative] // 2)
    lr[t], lt[t] = -0.5, -12.5
    if extreme:
        t = at(clipped, 30)
        lr[t], lt[t] = -70.0, -5.0
    lt[at(nan_seq, 25)] = np.nan
    ids = [f"req-{i:04d}" for i in range(num_sequences)]
    return StepBatch.from_packed(lr.astype(dtype), lt.astype(dtype), cu, ids, mask=mask)


@pytest.fixture
def make_skewed_batch():
    """`skewed_batch(dtype, num_sequences, seed)`, as a fixture (test modules are not a package)."""
    return skewed_batch


def assert_same_stats(got, want, rtol: float) -> None:
    """`(metrics, offenders)` pairs agree: same keys, counts exact, floats to `rtol`, offenders equal."""
    (metrics, offenders), (ref_metrics, ref_offenders) = got, want
    assert metrics.keys() == ref_metrics.keys()
    for key, ref in ref_metrics.items():
        if key.endswith("_count") or key.endswith("/count"):
            assert metrics[key] == ref, key
        else:
            np.testing.assert_allclose(metrics[key], ref, rtol=rtol, atol=0.0, err_msg=key)
    assert [(o.request_id, o.index) for o in offenders] == [(o.request_id, o.index) for o in ref_offenders]
    assert offenders == ref_offenders


@pytest.fixture
def assert_stats_equal():
    """`assert_same_stats(got, want, rtol)`, as a fixture."""
    return assert_same_stats


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(arch) -> Path`: a tiny random model from `rlcheck.modelzoo` (seed 0, float32),
    built on first use and shared by the whole test session."""
    built = {}

    def get(arch: str):
        if arch not in built:
            from rlcheck.modelzoo import build_model

            built[arch] = build_model(arch, tmp_path_factory.mktemp(f"model-{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray session for the whole test session (4 logical CPUs: a rollout actor, two trainer
    ranks and room to spare), shut down at the end."""
    ray = pytest.importorskip("ray")
    from rlcheck.loop import ray_session

    with ray_session(num_cpus=4, log_to_driver=False):
        yield ray
