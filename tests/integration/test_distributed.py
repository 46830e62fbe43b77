"""`all_reduce_partial` over a real gloo process group equals the single-process statistics.

Two processes on localhost each take half the sequences of one batch (rank 0 the first half),
reduce, finalize, and hand their result back to the test through a pickle file.
"""

from __future__ import annotations

import pickle
import socket

import numpy as np
import pytest

from rlcheck.errors import ConfigError
from rlcheck.stats import StatsConfig, compute, compute_partial, finalize

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, batch, cfgs: list[StatsConfig], out_dir: str, empty_rank: int = -1) -> None:
    """One rank: its share of the sequences under `cfgs[rank]`, reduced over gloo, finalized; the
    result (or the error raised) pickled to `out_dir/rank<r>.pkl`. Rank `empty_rank` has no sequence
    this step and contributes `empty_partial`; the others split the batch."""
    import torch.distributed as dist

    from rlcheck.distributed import all_reduce_partial
    from rlcheck.stats import empty_partial

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        if rank == empty_rank:
            partial = empty_partial(cfgs[rank])
        else:
            holders = [r for r in range(WORLD_SIZE) if r != empty_rank]
            share = np.array_split(np.arange(batch.num_sequences), len(holders))[holders.index(rank)]
            partial = compute_partial(batch.select(share), cfgs[rank])
        reduced = all_reduce_partial(partial)
        result = (finalize(reduced, cfgs[rank]), reduced.hists, reduced.num_sequences)
    except ConfigError as exc:
        result = exc
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def _run(batch, cfgs: list[StatsConfig], out_dir, empty_rank: int = -1) -> list:
    """Results of every rank, in rank order."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(_free_port(), batch, cfgs, str(out_dir), empty_rank), nprocs=WORLD_SIZE, join=True)
    results = []
    for rank in range(WORLD_SIZE):
        with open(out_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestAllReducePartial:
    @pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-9), (np.float32, 1e-5)])
    def test_two_ranks_equal_single_process(
        self, make_skewed_batch, assert_stats_equal, tmp_path, dtype, rtol
    ):
        """Every rank gets the single-process metrics, histograms and offenders (ids and global indices)."""
        batch, cfg = make_skewed_batch(dtype), StatsConfig()
        want, whole = compute(batch, cfg), compute_partial(batch, cfg)
        for got, hists, num_sequences in _run(batch, [cfg] * WORLD_SIZE, tmp_path):
            assert_stats_equal(got, want, rtol)
            assert num_sequences == batch.num_sequences
            assert hists.keys() == whole.hists.keys()
            for key in whole.hists:
                np.testing.assert_array_equal(hists[key], whole.hists[key])

    def test_different_configs_raise_on_every_rank(self, make_skewed_batch, tmp_path):
        """Ranks whose statistics do not line up (other thresholds) all raise ConfigError, none hangs."""
        cfgs = [StatsConfig(), StatsConfig(thresholds=(0.2,))]
        for result in _run(make_skewed_batch(), cfgs, tmp_path):
            assert isinstance(result, ConfigError)

    @pytest.mark.parametrize("empty_rank", [0, 1])
    def test_a_rank_with_nothing_to_compare(self, make_skewed_batch, assert_stats_equal, tmp_path, empty_rank):
        """A rank without sequences joins with empty_partial: no hang, every rank gets the other's statistics."""
        batch, cfg = make_skewed_batch(), StatsConfig()
        want = compute(batch, cfg)
        for got, _hists, num_sequences in _run(batch, [cfg] * WORLD_SIZE, tmp_path, empty_rank):
            assert_stats_equal(got, want, 1e-9)
            assert num_sequences == batch.num_sequences
