"""`rlcheck.distributed` over a real gloo process group: `all_reduce_partial` equals the
single-process statistics, and `observe_across_ranks` makes every rank return or raise together.

Two processes on localhost each take their share of the sequences (rank 0 the first), run the
collective, and hand their result back to the test through a pickle file.
"""

from __future__ import annotations

import os
import pickle
import socket
import time

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch, concat_batches
from rlcheck.core.stats import StatsConfig, compute, compute_partial, finalize
from rlcheck.errors import ConfigError

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

    from rlcheck.core.stats import empty_partial
    from rlcheck.distributed import all_reduce_partial

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


# ---- observe_across_ranks ------------------------------------------------------------------------

BAD_EXTRA, MONITOR_BUG, HALT = 2, 3, 4
"""The steps of the scripted run below where rank 0's Monitor refuses its input, where it fails
with a non-rlcheck error, and where the batch (every token off by 3 nats) halts the run."""


def _share(rng, rank: int, step: int, offset: float = 0.0) -> StepBatch:
    """Rank `rank`'s 4 rows of one step; trainer logprobs within 1e-3 of the rollout's, plus `offset`."""
    lr = -rng.exponential(1.0, (4, 6))  # (B, C)
    mask = np.ones((4, 6), dtype=bool)
    mask[:, 4 + rank:] = False
    lt = np.minimum(lr + rng.normal(0, 1e-3, lr.shape), 0.0) + offset
    ids = [f"s{step}-r{rank}-{i}" for i in range(4)]
    return StepBatch.from_padded(lr, lt, mask, ids, meta={"rank": [rank] * 4})


def _observe_rank_main(rank: int, port: int, steps: list, out_dir: str) -> None:
    """One rank of the scripted run: `steps[s][rank]` is its batch at step s (None: nothing to
    compare); each step's outcome ("ok", metrics), ("halt", ...) or ("error", ...) is pickled."""
    import torch.distributed as dist

    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.distributed import all_ranks_agree, observe_across_ranks
    from rlcheck.errors import MismatchHalt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    cfg = MonitorConfig(run_dir=f"{out_dir}/run", sinks=("jsonl",))
    monitor = Monitor(cfg) if rank == 0 else None
    results: list = [all_ranks_agree(True), all_ranks_agree(rank == 0)]
    for step, batches in enumerate(steps):
        extra = {"rlcheck/not-yours": 1.0} if step == BAD_EXTRA and rank == 0 else None
        if step == MONITOR_BUG and rank == 0:
            monitor.observe_partial = lambda *a, **kw: 1 / 0
        try:
            sample = {0: 0.02 * (rank + 1), 1: 0.02 if rank == 0 else None}.get(step)  # each rank's measured floor
            report = observe_across_ranks(monitor, step, batches[rank], cfg.stats, extra=extra, floor_sample=sample)
            results.append(("ok", report.step, report.metrics))
        except MismatchHalt as halt:
            results.append(("halt", halt.report.step, halt.report.metrics, halt.reason, halt.dump_dir))
            break
        except Exception as exc:
            results.append(("error", type(exc).__name__, str(exc)))
        finally:
            if monitor is not None:
                monitor.__dict__.pop("observe_partial", None)
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def _run_bounded(fn, args: tuple, out_dir, timeout_s: float = 120.0) -> list:
    """`fn(rank, *args)` on every rank; the ranks are killed and the test fails if they do not all
    finish within `timeout_s` (a hang, not slowness: the run takes a few seconds). Results in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the ranks did not finish within {timeout_s:.0f} s: a rank hangs in a collective")
    results = []
    for rank in range(WORLD_SIZE):
        with open(out_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


@pytest.fixture(scope="module")
def across_ranks(tmp_path_factory):
    """The scripted 5-step run at world size 2: (per-step batches, run dir, each rank's outcomes)."""
    out = tmp_path_factory.mktemp("across-ranks")
    rng = np.random.default_rng(0)
    steps = [[_share(rng, r, s, -3.0 if s == HALT else 0.0) for r in range(WORLD_SIZE)] for s in range(HALT + 1)]
    steps[1][1] = None  # rank 1 has nothing to compare at step 1
    results = _run_bounded(_observe_rank_main, (_free_port(), steps, str(out)), out)
    return steps, out / "run", results


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestObserveAcrossRanks:
    def test_ranks_agree_only_when_all_hold_the_flag(self, across_ranks):
        """all_ranks_agree is True when every rank says True, False when one says False."""
        _, _, results = across_ranks
        assert [r[:2] for r in results] == [[True, False]] * WORLD_SIZE

    def test_clean_step_returns_the_same_report_on_every_rank(self, across_ranks):
        """Step 0 gives both ranks the same report, whose metrics are the single-process metrics of
        both ranks' rows; at step 1 rank 1 passes None and the metrics are rank 0's rows alone."""
        steps, _, results = across_ranks
        got = [r[2:4] for r in results]
        assert got[0] == got[1]
        for step, batch in ((0, concat_batches(steps[0])), (1, steps[1][0])):
            kind, at, metrics = got[0][step]
            assert (kind, at) == ("ok", step)
            want, _ = compute(batch, StatsConfig())
            np.testing.assert_allclose(metrics[K.ABS_DIFF_MEAN], want[K.ABS_DIFF_MEAN], rtol=1e-9)
            assert metrics[K.TOKEN_COUNT] == want[K.TOKEN_COUNT]

    def test_the_ranks_measured_floors_are_averaged(self, across_ranks):
        """Each rank's measure of the model's own noise (`floor_sample`): step 0's record logs the ranks' mean (0.02
        and 0.04: 0.03), step 1's rank 0's alone (rank 1 measured nothing), the halting step none."""
        _, _, results = across_ranks
        measured = [r[2 + s][2].get(K.FLOOR_MEASURED) for r in results for s in (0, 1)]
        assert measured == pytest.approx([0.03, 0.02] * WORLD_SIZE)
        halt = results[0][2 + HALT]
        assert halt[0] == "halt" and K.FLOOR_MEASURED not in halt[2]

    def test_an_error_in_rank_0s_monitor_reaches_every_rank(self, across_ranks):
        """An InputError of rank 0's Monitor is raised as such on rank 1 too; an error that is not
        rlcheck's is raised on rank 0 and named in an RLCheckError on rank 1; the run goes on."""
        _, _, results = across_ranks
        bad = [r[2 + BAD_EXTRA] for r in results]
        assert [b[:2] for b in bad] == [("error", "InputError")] * WORLD_SIZE
        assert bad[0][2] == bad[1][2] and "rlcheck/not-yours" in bad[0][2]
        bug = [r[2 + MONITOR_BUG] for r in results]
        assert bug[0][:2] == ("error", "ZeroDivisionError")
        assert bug[1][:2] == ("error", "RLCheckError") and "ZeroDivisionError" in bug[1][2]

    def test_halt_stops_every_rank_with_one_dump_of_all_sequences(self, across_ranks):
        """The halting step raises MismatchHalt on both ranks with the same report, reason and dump
        dir; the run dir holds one dump, with both ranks' sequences in rank order."""
        import pyarrow.parquet as pq

        steps, run_dir, results = across_ranks
        halts = [r[-1] for r in results]
        assert all(len(r) == 2 + HALT + 1 for r in results)
        assert halts[0] == halts[1]
        kind, step, metrics, reason, dump_dir = halts[0]
        assert (kind, step) == ("halt", HALT) and reason and metrics[K.ABS_DIFF_MEAN] > 2
        assert os.listdir(run_dir / "dumps") == [os.path.basename(dump_dir)]
        ids = pq.read_table(os.path.join(dump_dir, "sequences.parquet")).column("request_id").to_pylist()
        assert ids == list(concat_batches(steps[HALT]).request_ids)


# ---- observe_across_ranks with quarantine --------------------------------------------------------

QUARANTINE_MAX_FRAC = 0.2
"""1 of the step's 8 sequences (12.5%) is quarantined, 4 of 8 halt."""


def _corrupted(rng, rank: int, step: int, rows: list[int]) -> StepBatch:
    """`_share` with the trainer's logprobs of `rows` 3 nats off (catastrophic sequences)."""
    clean = _share(rng, rank, step)
    lt = clean.logp_train.copy()
    for i in rows:
        lt[clean.cu_seqlens[i]:clean.cu_seqlens[i + 1]] -= 3.0
    return StepBatch.from_packed(clean.logp_rollout, lt, clean.cu_seqlens, clean.request_ids, meta=clean.meta)


def _early(rng, rank: int, step: int, rows: list[int]) -> StepBatch:
    """Rank `rank`'s 8 clean rows of 40 tokens, `rows` diverging by 0.8 nats at their second token
    only: an early divergence that no per-sequence rule condemns, only the step's burst of them."""
    lr = -rng.exponential(1.0, (8, 40))  # (B, C)
    lt = np.minimum(lr + rng.normal(0, 1e-3, lr.shape), 0.0)
    lt[rows, 1] = lr[rows, 1] - 0.8
    return StepBatch.from_padded(lr, lt, np.ones((8, 40), dtype=bool), [f"s{step}-r{rank}-{i}" for i in range(8)])


BURST_SIGNATURE = {"early_min_count": 3}
"""The run's early-burst level (the default is 4): the burst step's 3 early divergences (2 on rank 0, 1
on rank 1) are a burst of the whole step at it, and of neither rank's share."""


class _DeviceOnly:
    """Stands in for a GPU tensor of a rank's batch: it must not leave its rank (it refuses pickling)."""

    def __reduce__(self):
        raise TypeError("a rank's device tensor was sent to another rank")


def _quarantine_rank_main(rank: int, port: int, steps: list, out_dir: str) -> None:
    """One rank of a quarantining run: each step's ("ok", metrics, keep, quarantined) or ("halt", ...).
    At the last step rank 1's engine fails its sync check (a critical weights alarm of rank 1's only),
    and every batch holds device tensors (`_DeviceOnly`; the statistics read the host arrays)."""
    import torch.distributed as dist

    from rlcheck.core.detect import DetectorsConfig
    from rlcheck.core.detect.signature import SignatureConfig
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.core.quarantine import QuarantineConfig
    from rlcheck.core.types import Alarm
    from rlcheck.distributed import observe_across_ranks
    from rlcheck.errors import MismatchHalt

    os.environ["RLCHECK_STATS_BACKEND"] = "numpy"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    cfg = MonitorConfig(run_dir=f"{out_dir}/run", sinks=("jsonl",),
                        quarantine=QuarantineConfig(max_frac=QUARANTINE_MAX_FRAC),
                        detectors=DetectorsConfig(signature=SignatureConfig(**BURST_SIGNATURE)))
    monitor = Monitor(cfg) if rank == 0 else None
    results: list = []
    for step, batches in enumerate(steps):
        last = step == len(steps) - 1
        alarms = [Alarm("weights", "rlcheck/weights/sync_check", step, "critical", "sync check failed")] \
            if last and rank == 1 else []
        batch = batches[rank]
        if last:
            object.__setattr__(batch, "device_tensors", {"logp_rollout": _DeviceOnly()})
        try:
            r = observe_across_ranks(monitor, step, batch, cfg.stats, quarantine=cfg.quarantine,
                                     max_weight_lag=cfg.max_weight_lag, alarms=alarms)
            results.append(("ok", r.metrics, r.keep.tolist(), [(q.request_id, q.index) for q in r.quarantined],
                            r.batch.request_ids))
        except MismatchHalt as halt:
            r = halt.report
            results.append(("halt", [a.kind for a in r.alarms if a.severity == "critical"], r.keep.tolist(),
                            [a.message for a in r.alarms if a.kind == "weights"], halt.dump_dir))
            break
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


@pytest.fixture(scope="module")
def quarantine_across_ranks(tmp_path_factory):
    """Three steps at world size 2: one corrupted sequence (rank 1's row 2); a burst of early
    divergences split over the ranks; then four corrupted sequences (two a rank)."""
    out = tmp_path_factory.mktemp("quarantine-across-ranks")
    rng = np.random.default_rng(1)
    steps = [[_share(rng, 0, 0), _corrupted(rng, 1, 0, [2])],
             [_early(rng, 0, 1, [0, 5]), _early(rng, 1, 1, [3])],
             [_corrupted(rng, 0, 2, [0, 3]), _corrupted(rng, 1, 2, [1, 2])]]
    results = _run_bounded(_quarantine_rank_main, (_free_port(), steps, str(out)), out)
    return out / "run", results, steps


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestQuarantineAcrossRanks:
    def test_each_rank_keeps_its_own_clean_sequences(self, quarantine_across_ranks):
        """One corrupted sequence on rank 1: every rank's report says which of its own sequences to
        keep (rank 1's row 2 out, by its local index), with its own batch; no halt."""
        _, results, _ = quarantine_across_ranks
        (kind0, _, keep0, out0, ids0), (kind1, _, keep1, out1, ids1) = results[0][0], results[1][0]
        assert (kind0, kind1) == ("ok", "ok")
        assert keep0 == [True] * 4 and out0 == []
        assert keep1 == [True, True, False, True] and out1 == [("s0-r1-2", 2)]
        assert list(ids0) == [f"s0-r0-{i}" for i in range(4)] and list(ids1) == [f"s0-r1-{i}" for i in range(4)]

    def test_the_step_is_judged_on_the_kept_sequences(self, quarantine_across_ranks):
        """Both ranks get metrics counting the one quarantined sequence and, without it, the clean
        statistics (no critical alarm); the record lists it by its global index, its dump holds it."""
        import pyarrow.parquet as pq

        run_dir, results, _ = quarantine_across_ranks
        metrics = results[0][0][1]
        assert results[1][0][1] == metrics
        assert metrics[K.QUARANTINE_COUNT] == 1 and metrics[K.QUARANTINE_FRAC] == 1 / 8
        assert metrics[K.ABS_DIFF_MAX] < 0.1
        first = _records(run_dir)[0]
        assert [(q["request_id"], q["index"]) for q in first["quarantined"]] == [("s0-r1-2", 6)]
        assert not [a for a in first["alarms"] if a["severity"] == "critical"]
        table = pq.read_table(os.path.join(first["quarantine_dump"], "sequences.parquet"))
        assert table.column("request_id").to_pylist() == ["s0-r1-2"]

    def test_too_many_quarantined_halts_every_rank(self, quarantine_across_ranks):
        """Four of eight sequences past max_frac: both ranks raise MismatchHalt with a critical
        quarantine alarm, each report keeping its own rank's clean rows."""
        _, results, _ = quarantine_across_ranks
        (kind0, kinds0, keep0, *_), (kind1, kinds1, keep1, *_) = results[0][2], results[1][2]
        assert (kind0, kind1) == ("halt", "halt") and kinds0 == kinds1 and "quarantine" in kinds0
        assert keep0 == [False, True, True, False] and keep1 == [True, False, False, True]

    def test_the_early_burst_is_the_whole_steps(self, quarantine_across_ranks):
        """Three early divergences split 2 + 1 over the ranks are a burst of the step at the Monitor's
        SignatureConfig (early_min_count 3): the ranks quarantine what one process judging the whole
        step does, while neither rank's share alone (nor the default levels) is a burst."""
        from rlcheck.core.detect.signature import SignatureConfig
        from rlcheck.core.quarantine import QuarantineConfig, judge
        from rlcheck.core.stats import StatsConfig

        _, results, steps = quarantine_across_ranks
        (kind0, _, _, out0, _), (kind1, _, _, out1, _) = results[0][1], results[1][1]
        assert (kind0, kind1) == ("ok", "ok")
        assert out0 == [("s1-r0-0", 0), ("s1-r0-5", 5)] and out1 == [("s1-r1-3", 3)]
        whole, cfg, custom = StepBatch.concat(steps[1]), QuarantineConfig(max_frac=QUARANTINE_MAX_FRAC), \
            SignatureConfig(**BURST_SIGNATURE)
        one_process = judge(whole, StatsConfig(), cfg, signature=custom)
        assert [q.request_id for q in one_process.quarantined] == ["s1-r0-0", "s1-r0-5", "s1-r1-3"]
        assert all(judge(b, StatsConfig(), cfg, signature=custom).count == 0 for b in steps[1])  # per rank: none
        assert judge(whole, StatsConfig(), cfg).count == 0  # at the default levels: none

    def test_every_ranks_alarm_and_host_arrays_reach_the_halt(self, quarantine_across_ranks):
        """Rank 1's own failed sync check is judged with the step (a critical weights alarm naming rank 1
        on both ranks' reports), and the halt's dump of both ranks' sequences is written although the
        batches held device tensors (they stay on their rank)."""
        import pyarrow.parquet as pq

        _, results, _ = quarantine_across_ranks
        (_, kinds0, _, weights0, dump0), (_, kinds1, _, weights1, dump1) = results[0][2], results[1][2]
        assert "weights" in kinds0 and kinds0 == kinds1
        assert weights0 == weights1 == ["rank 1: sync check failed"]
        assert dump0 == dump1 and dump0 is not None
        assert pq.read_table(os.path.join(dump0, "sequences.parquet")).num_rows == 8


def _records(run_dir) -> list[dict]:
    import json

    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


# ---- the correction and MoE metrics, a rank's failure, the halt's dump (issue 42 items 4, 8, 9) ------

CORRECTION = dict(rollout_is="geometric", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
                  rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.002,0.8_1.25")
FAIL, AFTER, BIG_HALT = 2, 3, 4
"""Steps of the run below: rank 1's statistics fail (a simulated OOM); the run goes on; a halt of 30
sequences a rank."""


def _routed(rng, rank: int, step: int, rows: int = 6, length: int = 20) -> StepBatch:
    """Rank `rank`'s `rows` sequences with a spread of mismatch (so the correction rejects some) and a
    2-layer top-2 MoE routing that differs on every 5th token."""
    lr = -rng.exponential(1.0, (rows, length))
    lt = np.minimum(lr + rng.normal(0, 1.0, (rows, 1)) * 0.05 * rng.normal(0, 1.0, lr.shape), 0.0)
    experts = rng.integers(0, 8, (rows * length, 2, 2))
    moved = experts.copy()
    moved[::5, 0, 1] = (moved[::5, 0, 1] + 3) % 8
    from rlcheck.core.moe import Routing

    return StepBatch.from_packed(lr.reshape(-1), lt.reshape(-1), np.arange(rows + 1, dtype=np.int64) * length,
                                 [f"s{step}-r{rank}-{i}" for i in range(rows)], routing=Routing(experts, moved))


def _extras_rank_main(rank: int, port: int, steps: list, out_dir: str) -> None:
    """One rank of the run of `extras_across_ranks`: each step's ("ok", metrics, this rank's correction
    weights), ("error", class, message) or ("halt", reason, dump dir)."""
    import torch.distributed as dist

    import rlcheck.distributed as D
    from rlcheck.core.correction import CorrectionConfig
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.errors import MismatchHalt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    cfg = MonitorConfig(run_dir=f"{out_dir}/run", sinks=("jsonl",), correction=CorrectionConfig(**CORRECTION))
    monitor = Monitor(cfg) if rank == 0 else None
    results: list = []
    real = D.compute_partial
    for step, batches in enumerate(steps):
        if step == FAIL and rank == 1:
            D.compute_partial = lambda *a: (_ for _ in ()).throw(RuntimeError("CUDA out of memory (simulated)"))
        try:
            r = D.observe_across_ranks(monitor, step, batches[rank], cfg.stats, correction=cfg.correction)
            weights = None if r.batch is None else r.correction(**CORRECTION).weights
            results.append(("ok", r.metrics, weights))
        except MismatchHalt as halt:
            results.append(("halt", halt.reason, halt.dump_dir, halt.problems))
            break
        except Exception as exc:
            results.append(("error", type(exc).__name__, str(exc)))
        finally:
            D.compute_partial = real
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


@pytest.fixture(scope="module")
def extras_across_ranks(tmp_path_factory):
    """Five steps at world size 2 with the correction on and MoE routing: a whole step; rank 1 with
    nothing; rank 1's statistics failing; a clean step after; rank 0's 30 sequences 3 nats off (a halt)."""
    out = tmp_path_factory.mktemp("extras-across-ranks")
    rng = np.random.default_rng(7)
    steps = [[_routed(rng, r, s) for r in range(WORLD_SIZE)] for s in range(AFTER + 1)]
    steps[1][1] = None
    big = [_routed(rng, r, BIG_HALT, rows=30) for r in range(WORLD_SIZE)]
    big[0] = StepBatch.from_packed(big[0].logp_rollout, big[0].logp_train - 3.0, big[0].cu_seqlens,
                                   big[0].request_ids, routing=big[0].routing)
    steps.append(big)
    results = _run_bounded(_extras_rank_main, (_free_port(), steps, str(out)), out)
    return steps, out / "run", results


def _one_process(batch: StepBatch, tmp_path) -> tuple[dict, np.ndarray]:
    """The metrics and correction weights one Monitor gives `batch` (the ranks' batches joined)."""
    from rlcheck.core.correction import CorrectionConfig
    from rlcheck.core.monitor import Monitor, MonitorConfig

    with Monitor(MonitorConfig(run_dir=tmp_path, sinks=(), correction=CorrectionConfig(**CORRECTION))) as mon:
        report = mon.observe(0, batch)
    return report.metrics, report.correction(**CORRECTION).weights


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestExtrasAcrossRanks:
    def test_correction_and_moe_metrics_equal_one_process(self, extras_across_ranks, tmp_path):
        """Every rlcheck/corr/* and rlcheck/moe/* metric of both ranks equals one process's of the joined
        batch (absent before: the Monitor got no batch across ranks), with rank 1 holding nothing too."""
        steps, _, results = extras_across_ranks
        for step, batch in ((0, StepBatch.concat(steps[0])), (1, steps[1][0])):
            want, _ = _one_process(batch, tmp_path / f"one-{step}")
            keys = [k for k in want if k.startswith(("rlcheck/corr/", "rlcheck/moe/"))]
            assert any(k.startswith("rlcheck/corr/rollout_rs_token_k1") for k in keys) and "rlcheck/moe/num_tokens" in keys
            for rank in range(WORLD_SIZE):
                kind, got, _ = results[rank][step]
                assert kind == "ok" and set(keys) <= set(got)
                for key in keys:
                    assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (step, rank, key)

    def test_each_ranks_weights_are_its_share_of_one_process(self, extras_across_ranks, tmp_path):
        """Each rank's report.correction() weights (normalized by the whole step's mean, as verl's
        distributed mean) are its rows of one process's weights."""
        steps, _, results = extras_across_ranks
        _, want = _one_process(StepBatch.concat(steps[0]), tmp_path / "one")
        split = steps[0][0].num_tokens
        np.testing.assert_allclose(results[0][0][2], want[:split], rtol=1e-6)
        np.testing.assert_allclose(results[1][0][2], want[split:], rtol=1e-6)

    def test_a_failure_on_rank_1_reaches_every_rank(self, extras_across_ranks):
        """Rank 1's statistics raising (an OOM) is raised on rank 1 and, naming rank 1 and the error, on
        rank 0: nobody waits for the process-group timeout; the next step runs on both."""
        _, _, results = extras_across_ranks
        assert results[1][FAIL][:2] == ("error", "RuntimeError")
        assert results[0][FAIL][:2] == ("error", "RLCheckError")
        assert "rank 1" in results[0][FAIL][2] and "CUDA out of memory" in results[0][FAIL][2]
        assert results[0][AFTER][0] == results[1][AFTER][0] == "ok"

    def test_the_halt_dumps_each_ranks_worst_sequences(self, extras_across_ranks):
        """The halt's dump holds each rank's worst sequences (its top_k offenders: 20 of the step's 60),
        the step's own offenders among them; meta.json says so, with the whole step's metrics."""
        import json

        import pyarrow.parquet as pq

        steps, run_dir, results = extras_across_ranks
        halts = [r[-1] for r in results]
        assert halts[0][0] == "halt" and halts[0][2] == halts[1][2] and halts[0][3] == ()
        dump = halts[0][2]
        ids = pq.read_table(os.path.join(dump, "sequences.parquet")).column("request_id").to_pylist()
        meta = json.loads(open(os.path.join(dump, "meta.json")).read())
        assert len(ids) == 2 * 10 and meta["selected"]["of_sequences"] == 60 and meta["num_sequences"] == 20
        assert {o["request_id"] for o in meta["offenders"]} <= set(ids)
        assert meta["metrics"][K.SEQ_COUNT] == 60
