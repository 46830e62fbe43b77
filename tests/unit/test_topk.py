"""Top-K beyond the sampled token: the `TopK` data type, `StepBatch.topk`, and the `rlcheck/dist/*`
statistics (overlap, argmax agreement, tail masses, bucketed KL) against a per-position brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlcheck import Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.limits import MIN_LOGPROB
from rlcheck.core.run.dump import read_dump
from rlcheck.core.run.journal import read_jsonl
from rlcheck.core.stats import StatsConfig, compute, compute_partial, empty_partial, finalize, merge
from rlcheck.core.topk import TopK, from_engine_dicts
from rlcheck.errors import ConfigError, InputError

DIST_ON = StatsConfig(distribution=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_k(logp: np.ndarray, k: int) -> np.ndarray:
    """(M, k) ids by logprob descending, ties by id."""
    return np.lexsort((np.broadcast_to(np.arange(logp.shape[1]), logp.shape), -logp), axis=1)[:, :k]


def make_topk(logits_e: np.ndarray, logits_t: np.ndarray, k: int) -> TopK:
    """Both sides' top-k from full (M, V) logits, as the engine and the trainer produce them."""
    le, lt = log_softmax(logits_e), log_softmax(logits_t)  # (M, V)
    ie, it = top_k(le, k), top_k(lt, k)
    rows = np.arange(le.shape[0])[:, None]
    return TopK.from_packed(ie, le[rows, ie], lt[rows, ie], it)


def batch_with(topk: TopK, num_sequences: int = 4, mask: np.ndarray | None = None) -> StepBatch:
    """A batch of `topk.num_tokens` tokens split into sequences, the sampled logprobs from column 0."""
    cu = np.linspace(0, topk.num_tokens, num_sequences + 1).astype(np.int64)
    lr, lt = (np.where(np.isfinite(a[:, 0]), a[:, 0], -1.0) for a in (topk.logp_rollout, topk.logp_train))
    return StepBatch.from_packed(lr, lt, cu,
                                 [f"r{i}" for i in range(num_sequences)], mask=mask, topk=topk)


def random_topk(seed=0, m=64, vocab=60, k=8, noise=0.3, temperature=1.0) -> TopK:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, (m, vocab))
    return make_topk(logits, (logits + rng.normal(0, noise, logits.shape)) / temperature, k)


def brute_force(topk: TopK, rows) -> dict[str, float]:
    """The metrics position by position, with sets and Python floats (the module docstring's formulas)."""
    kl, overlap, top1, te, tt = [], [], [], [], []
    res = topk.k * float(np.finfo(np.float32).eps)
    for i in rows:
        e = {int(v): (float(a), float(b)) for v, a, b in zip(topk.ids_rollout[i], topk.logp_rollout[i],
                                                            topk.logp_train[i], strict=True) if v != -1}
        r = {int(v) for v in topk.ids_train[i] if v != -1}
        tail_e = max(1 - sum(math.exp(a) for a, _ in e.values()), 0.0)
        tail_t = max(1 - sum(math.exp(b) for _, b in e.values()), 0.0)
        total = sum(math.exp(a) * (a - max(b, MIN_LOGPROB)) for a, b in e.values() if math.exp(a) > 0)
        if tail_e > 0:
            total += tail_e * (math.log(max(tail_e, res)) - math.log(max(tail_t, res)))
        kl.append(total)
        possible = {v for v, (a, _) in e.items() if math.isfinite(a)}  # probability > 0 to the engine
        overlap.append(len(possible & r) / max(len(possible), 1))
        top1.append(max(e, key=lambda v: (e[v][0], -v)) == int(topk.ids_train[i][0]))
        te.append(tail_e)
        tt.append(tail_t)
    n = len(kl)
    return {K.DIST_COUNT: n, K.DIST_KL_MEAN: max(sum(kl) / n, 0.0), K.DIST_KL_MAX: max(max(kl), 0.0),
            K.DIST_TOPK_OVERLAP_MEAN: sum(overlap) / n, K.DIST_TOP1_AGREE_FRAC: sum(top1) / n,
            K.DIST_TAIL_MASS_ROLLOUT_MEAN: sum(te) / n, K.DIST_TAIL_MASS_TRAIN_MEAN: sum(tt) / n}


def dist_metrics(batch: StepBatch, cfg: StatsConfig = DIST_ON) -> dict[str, float]:
    return {k: v for k, v in compute(batch, cfg)[0].items() if k.startswith("rlcheck/dist/")}


class TestTopKValidation:
    def test_shapes_must_match(self):
        """Fields of different shapes, or 1-D fields, are an InputError naming the field."""
        ids, lp = np.zeros((3, 2), np.int64), np.zeros((3, 2), np.float32)
        with pytest.raises(InputError, match="topk.logp_train has shape"):
            TopK(ids, lp, lp[:2], ids)
        with pytest.raises(InputError, match="topk.ids_rollout has shape"):
            TopK(ids[:, 0], lp, lp, ids)

    def test_ids_and_logprobs_checked(self):
        """Ids below -1, duplicate ids in a row, NaN and positive logprobs are refused; -inf is padding."""
        ids = np.array([[3, 1], [2, -1]], np.int64)
        lp = np.array([[-0.1, -2.0], [-0.5, -np.inf]], np.float32)
        TopK(ids, lp, lp, ids)
        with pytest.raises(InputError, match="ids are >= 0"):
            TopK(ids - 2, lp, lp, ids)
        with pytest.raises(InputError, match="appears twice"):
            TopK(ids, lp, lp, np.array([[3, 3], [2, -1]]))
        with pytest.raises(InputError, match="logits or probabilities"):
            TopK(ids, lp, lp + 1.0, ids)
        with pytest.raises(InputError, match="nan"):
            TopK(ids, np.where(lp < -1, np.nan, lp).astype(np.float32), lp, ids)
        with pytest.raises(InputError, match="int64"):
            TopK(ids.astype(np.int32), lp, lp, ids)

    def test_batch_checks_rows(self):
        """A TopK with a row count other than the batch's tokens is refused."""
        topk = random_topk(m=10)
        with pytest.raises(InputError, match="topk has 9 rows for 10 tokens"):
            batch_with(topk).__class__.from_packed(np.zeros(10), np.zeros(10), [0, 10], ["a"], topk=topk.take(np.arange(9)))

    def test_concat_needs_one_k(self):
        """Joining TopKs of different K is an InputError."""
        with pytest.raises(InputError, match="different K"):
            TopK.concat([random_topk(k=4), random_topk(k=5)])


class TestFromEngineDicts:
    def test_keeps_top_k_drops_extra_sampled_token(self):
        """The k best by logprob (ties by id) are kept, sorted; vLLM's extra sampled token is dropped."""
        top = [{7: -0.2, 3: -1.5, 9: -3.0}, {4: -1.0, 2: -1.0, 8: -9.0}]
        ids, lp = from_engine_dicts(top, 2)
        assert ids.dtype == np.int64 and lp.dtype == np.float32
        np.testing.assert_array_equal(ids, [[7, 3], [2, 4]])
        np.testing.assert_allclose(lp, [[-0.2, -1.5], [-1.0, -1.0]])

    def test_short_rows_and_none_padded(self):
        """Fewer than k entries, or no dict at all, pad with id -1 and logprob -inf."""
        class Logprob:  # vLLM's value type
            def __init__(self, logprob):
                self.logprob = logprob

        ids, lp = from_engine_dicts([{5: Logprob(-0.3)}, None, {}], 3)
        np.testing.assert_array_equal(ids, [[5, -1, -1], [-1, -1, -1], [-1, -1, -1]])
        assert lp[0, 0] == np.float32(-0.3) and np.isneginf(lp[0, 1:]).all() and np.isneginf(lp[1:]).all()

    def test_bad_k(self):
        """k < 1 is a ConfigError."""
        with pytest.raises(ConfigError, match="k must be"):
            from_engine_dicts([{1: -0.1}], 0)


class TestStepBatchCarriesTopK:
    def test_ragged_select_concat(self):
        """from_ragged keeps the rows in order; select and concat carry them with their tokens."""
        topk = random_topk(m=9)
        parts = [np.arange(0, 4), np.arange(4, 9)]
        ragged = TopK.from_ragged(*([getattr(topk, f)[p] for p in parts]
                                    for f in ("ids_rollout", "logp_rollout", "logp_train", "ids_train")))
        lr = [topk.logp_rollout[p, 0] for p in parts]
        batch = StepBatch.from_ragged(lr, [x.copy() for x in lr], ["a", "b"], topk=ragged)
        np.testing.assert_array_equal(batch.topk.ids_rollout, topk.ids_rollout)
        picked = batch.select([1])
        np.testing.assert_array_equal(picked.topk.ids_train, topk.ids_train[4:])
        other = StepBatch.from_ragged(lr[:1], [x.copy() for x in lr[:1]], ["c"], topk=ragged.take(np.arange(4)))
        joined = StepBatch.concat([picked, other])
        np.testing.assert_array_equal(joined.topk.logp_train, np.concatenate([topk.logp_train[4:], topk.logp_train[:4]]))
        assert StepBatch.concat([picked, StepBatch.from_ragged(lr[:1], [x.copy() for x in lr[:1]], ["d"])]).topk is None

    def test_padded_picks_the_response_rows(self):
        """from_padded takes a TopK of B*T rows and keeps those of the packed tokens."""
        topk = random_topk(m=6, k=3)
        mask = np.array([[0, 1, 1], [1, 0, 0]])
        lp = topk.logp_rollout[:, 0].reshape(2, 3)
        batch = StepBatch.from_padded(lp, lp.copy(), mask, ["a", "b"], topk=topk)
        np.testing.assert_array_equal(batch.topk.ids_rollout, topk.ids_rollout[[1, 2, 3]])


class TestDistributionStats:
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_matches_brute_force(self, seed):
        """Every dist metric equals the per-position Python computation (with masked and padded rows)."""
        topk = random_topk(seed, m=80, k=6, noise=0.8)
        ids, lpe = topk.ids_rollout.copy(), topk.logp_rollout.copy()
        ids[5, 4:], lpe[5, 4:] = -1, -np.inf  # a short engine row
        ids[7], lpe[7] = -1, -np.inf  # a position the engine did not score
        topk = TopK(ids, lpe, np.where(ids == -1, -np.inf, topk.logp_train).astype(np.float32), topk.ids_train)
        mask = np.random.default_rng(seed).random(80) > 0.2
        got = dist_metrics(batch_with(topk, mask=mask))
        want = brute_force(topk, [i for i in range(80) if mask[i] and i != 7])
        assert got.keys() == want.keys() == set(K.DIST)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key

    def test_identical_distributions(self):
        """The same distribution on both sides: KL 0, full overlap, argmaxes agree."""
        logits = np.random.default_rng(3).normal(0, 2.0, (50, 40))
        got = dist_metrics(batch_with(make_topk(logits, logits, 10)))
        assert got[K.DIST_KL_MEAN] == 0.0 and got[K.DIST_KL_MAX] == 0.0
        assert got[K.DIST_TOPK_OVERLAP_MEAN] == 1.0 and got[K.DIST_TOP1_AGREE_FRAC] == 1.0
        assert got[K.DIST_TAIL_MASS_ROLLOUT_MEAN] == pytest.approx(got[K.DIST_TAIL_MASS_TRAIN_MEAN])

    def test_tempered_trainer(self):
        """A trainer at temperature 1.5 (logits / T): KL > 0 and more tail mass on the trainer side."""
        got = dist_metrics(batch_with(random_topk(4, noise=0.0, temperature=1.5)))
        assert got[K.DIST_KL_MEAN] > 1e-3 and got[K.DIST_KL_MAX] >= got[K.DIST_KL_MEAN]
        assert got[K.DIST_TAIL_MASS_TRAIN_MEAN] > got[K.DIST_TAIL_MASS_ROLLOUT_MEAN]
        assert got[K.DIST_TOPK_OVERLAP_MEAN] == 1.0  # a monotone transform keeps the ranking

    def test_merge_equals_one_pass(self):
        """Partials of two halves, merged, give the metrics of one pass; a part without topk (or empty) adds nothing."""
        batch = batch_with(random_topk(5, m=90, noise=0.5), num_sequences=6)
        parts = [compute_partial(batch.select(np.arange(3)), DIST_ON),
                 compute_partial(batch.select(np.arange(3, 6)), DIST_ON)]
        plain = StepBatch.from_ragged([np.full(3, -0.5)], [np.full(3, -0.5)], ["x"])
        merged = finalize(merge(parts + [compute_partial(plain, DIST_ON), empty_partial(DIST_ON)]), DIST_ON)[0]
        whole = dist_metrics(batch)
        for key in K.DIST:
            assert merged[key] == pytest.approx(whole[key], rel=1e-12), key

    def test_off_or_absent_logs_nothing(self):
        """distribution=False, or a batch without topk, yields no rlcheck/dist key."""
        batch = batch_with(random_topk(6))
        assert dist_metrics(batch, StatsConfig()) == {}
        assert dist_metrics(StepBatch.from_ragged([np.full(3, -0.5)], [np.full(3, -0.5)], ["x"])) == {}

    def test_chunked_rows(self, monkeypatch):
        """Rows processed in several chunks give the same sums as one chunk."""
        from rlcheck.core.stats import distribution

        batch = batch_with(random_topk(7, m=100))
        whole = dist_metrics(batch)
        monkeypatch.setattr(distribution, "_CHUNK", 7 * 8)  # 7 rows of K = 8 per pass
        chunked = dist_metrics(batch)
        for key in K.DIST:
            assert chunked[key] == pytest.approx(whole[key], rel=1e-12), key


class TestMonitorLogsDistribution:
    def test_record_holds_dist_metrics(self, tmp_path):
        """A Monitor with StatsConfig(distribution=True) logs rlcheck/dist/* for a batch with topk."""
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), stats=DIST_ON))
        report = mon.observe(0, batch_with(random_topk(8, noise=0.2)))
        mon.close()
        assert report.metrics[K.DIST_KL_MEAN] > 0 and report.metrics[K.DIST_COUNT] == 64
        record = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
        assert record["metrics"][K.DIST_KL_MEAN] == report.metrics[K.DIST_KL_MEAN]

    def test_dump_leaves_topk_out(self, tmp_path):
        """A batch with topk dumps as one without (dumps do not store the top-k)."""
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), stats=DIST_ON))
        batch = batch_with(random_topk(9))
        rows, _ = read_dump(mon.dump(0, batch, mon.observe(0, batch)))
        mon.close()
        assert len(rows) == batch.num_sequences and not any("topk" in key for key in rows[0])


class TestImpossibleTokens:
    def test_overlap_counts_only_what_the_engine_can_sample(self):
        """Tokens the engine lists at -inf (outside a top-p nucleus) are not part of its set: a
        trainer ranking the two possible tokens first overlaps fully, whatever it ranks next."""
        ids = np.array([[5, 7, 1, 2]], dtype=np.int64)
        topk = TopK(ids_rollout=ids, logp_rollout=np.array([[-0.1, -2.4, -np.inf, -np.inf]], np.float32),
                    logp_train=np.array([[-0.2, -2.0, -5.0, -6.0]], np.float32),
                    ids_train=np.array([[5, 7, 9, 8]], dtype=np.int64))
        batch = StepBatch.from_ragged(logp_rollout=[np.array([-0.1], np.float32)],
                                      logp_train=[np.array([-0.2], np.float32)], request_ids=["a"], topk=topk)
        m = dist_metrics(batch)
        assert m[K.DIST_TOPK_OVERLAP_MEAN] == 1.0 and m[K.DIST_KL_MEAN] > 0
