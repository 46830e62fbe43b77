"""The torch path of the statistics (`rlcheck.core.stats.torch_partial`) against the numpy path: the
same PartialStats (keys, counts, histograms, offenders in order) and the same finalize metrics, on
seeded random batches holding every awkward token (masks, NaN, -inf, -1e9, |d| > 20, d past
RATIO_LOG_CAP, empty sequences), in float32 and float64, with token ids, top-K and weight versions;
merged partials; the device code path (int cumsums, segment_reduce) run on the CPU; StepBatch built
from torch tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlcheck.core.batch import StepBatch  # noqa: E402
from rlcheck.core.stats import StatsConfig, compute_partial, finalize, merge  # noqa: E402
from rlcheck.core.stats import torch_kernels as TK  # noqa: E402
from rlcheck.core.stats.backend import choose  # noqa: E402
from rlcheck.core.topk import PAD_ID, TopK  # noqa: E402
from rlcheck.errors import InputError  # noqa: E402

NUMPY, EAGER = StatsConfig(backend="numpy"), StatsConfig(backend="torch-eager")
COUNTS = {"n", "n_masked", "n_nonfinite", "ratio_above", "clipped", "cat_tok", "seq_total", "seq_n", "seq_empty",
          "seq_flagged", "seq_cat", "early_div", "early_any", "early_slots", "div_tokens", "sh_n", "tok_n",
          "tok_mismatch", "dist_n", "dist_top1"}


def make_batch(seed: int, dtype=np.float64, num_sequences: int = 60, extremes: bool = True, masked: bool = True,
               topk: bool = False) -> StepBatch:
    """Noise, diverged tokens (0.6-4 nats), long sequences (first divergences past 64), empty ones, mask
    holes and a fully masked sequence; with `extremes`: NaN, -inf, -1e9, |d| ~ 30 and d ~ 60 tokens."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 90, num_sequences)
    lens[rng.choice(num_sequences, 5, replace=False)] = 0
    lens[:8] = np.maximum(lens[:8], 12)
    lens[8] = 300
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    m = int(cu[-1])
    lr = -rng.exponential(1.5, m)
    lt = np.minimum(lr + rng.normal(0.0, 0.05, m), 0.0)
    t = rng.choice(m, 40, replace=False)
    d = rng.choice([-1, 1], 40) * rng.uniform(0.6, 4.0, 40)
    lr[t] = np.minimum(lr[t], -d)
    lt[t] = lr[t] + d
    lt[cu[8] + 200] = lr[cu[8] + 200] - 3.0  # a first divergence past the exact position bins
    mask = np.ones(m, dtype=bool)
    if masked:
        for i in rng.choice(num_sequences, num_sequences // 4, replace=False):
            if lens[i] >= 6:
                a = cu[i] + rng.integers(1, lens[i] // 2)
                mask[a:a + rng.integers(1, lens[i] // 2)] = False
        mask[cu[7]:cu[8]] = False
    if extremes:
        for i, pos, side, value in ((0, 3, "lt", np.nan), (1, 7, "lr", -np.inf), (2, 0, "lt", -1e9),
                                    (3, 5, "lr", np.nan)):
            (lt if side == "lt" else lr)[cu[i] + pos] = value
            mask[cu[i] + pos] = True
        lr[cu[4] + 1], lt[cu[4] + 1] = -35.0, -5.0  # |d| = 30
        lr[cu[5] + 2], lt[cu[5] + 2] = -70.0, -10.0  # d = 60 > RATIO_LOG_CAP
        lr[cu[6] + 4], lt[cu[6] + 4] = -0.5, -45.0  # d = -44.5: r from exp(d) itself
    tokens = rng.integers(0, 1000, m)
    tokens_train = tokens.copy()
    tokens_train[rng.choice(m, 5, replace=False)] += 1
    top = None
    if topk:
        k = 4
        ids = np.stack([rng.permutation(50)[:k] for _ in range(m)])  # (M, K) distinct per row
        ids_t = np.where(rng.random((m, k)) < 0.8, ids, ids + 100)
        le = np.log(rng.dirichlet(np.ones(k + 1), m)[:, :k])
        lt_k = np.minimum(le + rng.normal(0, 0.1, (m, k)), 0.0)
        ids[rng.choice(m, 10, replace=False), -1] = PAD_ID
        le[rng.choice(m, 10, replace=False), 0] = -np.inf
        top = TopK(ids, le.astype(np.float32), lt_k.astype(np.float32), ids_t)
    versions = rng.integers(3, 6, num_sequences)
    return StepBatch.from_packed(lr.astype(dtype), lt.astype(dtype), cu, [f"req-{i}" for i in range(num_sequences)],
                                 mask=mask if masked else None, tokens=tokens, tokens_train=tokens_train,
                                 weight_version=versions, topk=top)


def assert_same(p, q, cfg: StatsConfig, rel: float) -> None:
    """Two partials agree: key sets, counts exactly, sums and extrema to `rel`, histograms and
    versions equal, offenders in the same order; and so do their finalize metrics."""
    for part in ("sums", "maxima", "minima", "hists"):
        assert set(getattr(p, part)) == set(getattr(q, part)), part
    for key, a in p.sums.items():
        b = q.sums[key]
        if key in COUNTS or key.startswith("thr"):
            assert a == b, key
        else:
            assert math.isclose(a, b, rel_tol=rel, abs_tol=rel * 1e-3), (key, a, b)
    for part in ("maxima", "minima"):
        for key, a in getattr(p, part).items():
            assert math.isclose(a, getattr(q, part)[key], rel_tol=rel) or a == getattr(q, part)[key], (part, key)
    for key, h in p.hists.items():
        np.testing.assert_array_equal(h, q.hists[key], err_msg=key)
    assert p.versions == q.versions and p.num_sequences == q.num_sequences
    assert [(o.request_id, o.index, o.first_divergence, o.length, o.nonfinite) for o in p.offenders] == \
        [(o.request_id, o.index, o.first_divergence, o.length, o.nonfinite) for o in q.offenders]
    for o, r in zip(p.offenders, q.offenders, strict=True):
        assert math.isclose(o.max_abs_diff, r.max_abs_diff, rel_tol=rel)
        assert math.isclose(o.mean_diff, r.mean_diff, rel_tol=rel, abs_tol=rel * 1e-3)
    (mp, op), (mq, oq) = finalize(p, cfg), finalize(q, cfg)
    assert set(mp) == set(mq)
    for key, a in mp.items():
        assert math.isclose(a, mq[key], rel_tol=10 * rel, abs_tol=rel * 1e-3) or a == mq[key], (key, a, mq[key])
    assert op == oq


def both(batch: StepBatch, **kw):
    """(numpy partial, eager torch partial, config) of `batch` under StatsConfig(**kw)."""
    cfg = StatsConfig(**kw)
    return (compute_partial(batch, StatsConfig(backend="numpy", **kw)),
            compute_partial(batch, StatsConfig(backend="torch-eager", **kw)), cfg)


REL = {np.float64: 1e-9, np.float32: 1e-5}


class TestAgreement:
    @pytest.mark.parametrize("dtype", [np.float64, np.float32])
    @pytest.mark.parametrize("seed", range(6))
    def test_random_batches(self, seed, dtype):
        """Every awkward token at once: the torch partial is the numpy partial."""
        p, q, cfg = both(make_batch(seed, dtype))
        assert p.sums["n_nonfinite"] == 4 and p.sums["clipped"] == 1
        assert_same(p, q, cfg, REL[dtype])

    @pytest.mark.parametrize("dtype", [np.float64, np.float32])
    @pytest.mark.parametrize("masked", [True, False])
    def test_finite_batches(self, dtype, masked):
        """Without extreme tokens (float32 stays float32) and with or without a mask."""
        p, q, cfg = both(make_batch(7, dtype, extremes=False, masked=masked))
        assert_same(p, q, cfg, REL[dtype])

    def test_distribution(self):
        """Top-K rows with padding and -inf entries: the dist/ sums agree."""
        p, q, cfg = both(make_batch(3, np.float32, topk=True), distribution=True, top_k=25)
        assert p.sums["dist_n"] > 0
        assert_same(p, q, cfg, 1e-5)

    def test_other_config(self):
        """Other levels, windows and K."""
        kw = dict(thresholds=(0.05, 2.5), divergence_tau=0.3, catastrophic_tau=1.0, early_window=8, early_span=5,
                  shift_window=3, top_k=60, clip=0.2, catastrophic_min_tokens=1)
        p, q, cfg = both(make_batch(11), **kw)
        assert_same(p, q, cfg, 1e-9)

    def test_mixed_dtypes_and_one_token(self):
        """float32 against float64 sides, and a batch of one token."""
        b = make_batch(2)
        mixed = StepBatch.from_packed(b.logp_rollout.astype(np.float32), b.logp_train, b.cu_seqlens, b.request_ids)
        assert_same(*both(mixed)[:2], StatsConfig(), 1e-9)
        one = StepBatch.from_packed(np.array([-1.0]), np.array([-1.2]), np.array([0, 0, 1]), ["a", "b"])
        assert_same(*both(one)[:2], StatsConfig(), 1e-9)

    def test_merge(self):
        """Merging torch partials of three batches is merging their numpy partials."""
        batches = [make_batch(s, np.float32) for s in (20, 21, 22)]
        p = merge([compute_partial(b, NUMPY) for b in batches])
        q = merge([compute_partial(b, EAGER) for b in batches])
        assert_same(p, q, StatsConfig(), 1e-5)

    def test_device_code_path(self, monkeypatch):
        """The reductions a GPU runs (int cumsums, torch.segment_reduce: no host sync) agree too."""
        monkeypatch.setattr(TK, "host_path", lambda device: False)
        for seed in (0, 1):
            p, q, cfg = both(make_batch(seed, np.float32, topk=True), distribution=True)
            assert_same(p, q, cfg, 1e-5)

    def test_compiled(self):
        """One batch through torch.compile (or its eager fallback, where no compiler works)."""
        b = make_batch(4, np.float32, extremes=False)
        assert_same(compute_partial(b, NUMPY), compute_partial(b, StatsConfig(backend="torch")), StatsConfig(), 1e-5)


    def test_compile_failure_falls_back(self, monkeypatch):
        """A torch.compile that raises is logged once and eager torch gives the same partial."""
        def broken(*args, **kwargs):
            raise RuntimeError("no compiler")

        monkeypatch.setattr(TK, "_compiled", {"token_pass": broken})
        b = make_batch(5, np.float32, extremes=False)
        assert_same(compute_partial(b, NUMPY), compute_partial(b, StatsConfig(backend="torch")), StatsConfig(), 1e-5)
        assert TK._compiled["failed"]


class TestBackendChoice:
    def test_env_forces_numpy(self, monkeypatch):
        """RLCHECK_STATS_BACKEND=numpy keeps "auto" off torch (the torch modules are not needed)."""
        b = make_batch(0)
        monkeypatch.setenv("RLCHECK_STATS_BACKEND", "numpy")
        assert choose(b, "auto") == "numpy"
        monkeypatch.setenv("RLCHECK_STATS_BACKEND", "torch-eager")
        assert choose(b, "auto") == "torch-eager" and choose(b, "numpy") == "numpy"
        monkeypatch.delenv("RLCHECK_STATS_BACKEND")
        assert choose(b, "auto") == "numpy"  # a host batch: numpy is the faster on a CPU

    def test_bad_backend(self):
        """An unknown backend is a ConfigError naming the choices."""
        from rlcheck.errors import ConfigError

        with pytest.raises(ConfigError, match="backend"):
            StatsConfig(backend="jax")


class TestTorchBatch:
    @pytest.fixture
    def as_device(self, monkeypatch):
        """CPU tensors taken for device tensors: the GPU packing path, run here."""
        from rlcheck.core import batch_torch

        monkeypatch.setattr(batch_torch, "on_device", lambda x: hasattr(x, "detach"))

    def _padded(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        b, t = 6, 40
        lr = -rng.exponential(1.0, (b, t)).astype(np.float32)
        lt = np.minimum(lr + rng.normal(0, 0.3, (b, t)).astype(np.float32), 0.0)
        mask = np.zeros((b, t), dtype=bool)
        for i in range(b):
            lo, hi = sorted(rng.integers(0, t, 2))
            mask[i, lo:hi + 1] = True
        mask[2, 5:9] = False
        mask[4] = False
        lt[1, 3] = np.nan
        tokens = rng.integers(0, 100, (b, t))
        return lr, lt, mask, [f"r{i}" for i in range(b)], tokens

    def _both(self, lr, lt, mask, ids, tokens, **kw):
        nb = StepBatch.from_padded(lr, lt, mask, ids, tokens=tokens, tokens_train=tokens, **kw)
        t = torch.from_numpy
        tb = StepBatch.from_padded(t(lr), t(lt), t(mask), ids, tokens=t(tokens), tokens_train=t(tokens), **kw)
        return nb, tb

    @pytest.mark.parametrize("device", [False, True])
    def test_from_padded_torch_equals_numpy(self, device, request):
        """from_padded on torch tensors (on the CPU, or taken for a device's: packed by torch) gives the
        numpy batch's fields and statistics."""
        if device:
            request.getfixturevalue("as_device")
        nb, tb = self._both(*self._padded())
        assert (tb.device_tensors is not None) == device
        assert choose(tb, "auto") == ("torch-eager" if device else "numpy")
        for name in ("logp_rollout", "logp_train", "mask", "cu_seqlens", "tokens", "tokens_train"):
            np.testing.assert_array_equal(getattr(tb, name), getattr(nb, name))
            if device:
                np.testing.assert_array_equal(tb.device_tensors[name].numpy(), getattr(nb, name))
        assert_same(compute_partial(nb, NUMPY), compute_partial(tb, EAGER), StatsConfig(), 1e-5)
        assert_same(compute_partial(nb, NUMPY), compute_partial(tb, NUMPY), StatsConfig(), 1e-5)

    def test_half_precision_and_int_mask(self, as_device):
        """bf16 logprobs are widened to float32 and a 0/1 integer mask read, as on the numpy path."""
        lr, lt, mask, ids, tokens = self._padded(1)
        t = torch.from_numpy
        tb = StepBatch.from_padded(t(lr).bfloat16(), t(lt).bfloat16(), t(mask).long(), ids)
        nb = StepBatch.from_padded(t(lr).bfloat16().float().numpy(), t(lt).bfloat16().float().numpy(), mask, ids)
        assert tb.device_tensors["logp_rollout"].dtype == torch.float32
        assert_same(compute_partial(nb, NUMPY), compute_partial(tb, EAGER), StatsConfig(), 1e-5)

    def test_derived_batches_drop_device_tensors(self, as_device):
        """select, concat and dataclasses.replace read the numpy fields; what they build has no stale tensors."""
        import dataclasses

        nb, tb = self._both(*self._padded())
        np.testing.assert_array_equal(tb.select([3, 1]).logp_train, nb.select([3, 1]).logp_train)
        assert tb.select([0]).device_tensors is None
        other = StepBatch.from_packed(nb.logp_rollout, nb.logp_train, nb.cu_seqlens, [f"o{i}" for i in range(6)])
        assert StepBatch.concat([tb, other]).num_sequences == 12
        shifted = dataclasses.replace(tb, logp_train=np.minimum(tb.logp_train + 0.5, 0.0))
        assert shifted.device_tensors is None
        assert compute_partial(shifted, EAGER).sums["ad"] != compute_partial(tb, EAGER).sums["ad"]

    @pytest.mark.parametrize("device", [False, True])
    def test_validation_errors_are_the_same(self, device, request):
        """A logit among torch logprobs, mismatched shapes or a mask of 2s raise the numpy batch's InputError."""
        if device:
            request.getfixturevalue("as_device")
        lr, lt, mask, ids, _ = self._padded()
        lt[0, 2:4], mask[0, 2:4] = 0.5, True
        bad_mask = mask.astype(np.int64) * 2
        cases = [(lr, lt, mask), (lr, lt[:, :5], mask), (lr, lt, bad_mask), (lr.astype(np.int64), lt, mask)]
        for a, b, m in cases:
            msgs = []
            for conv in (np.asarray, torch.from_numpy):
                with pytest.raises(InputError) as err:
                    StepBatch.from_padded(conv(a), conv(b), conv(m), ids)
                msgs.append(str(err.value))
            assert msgs[0] == msgs[1] or "dtype" in msgs[0]  # dtypes print as int64 and torch.int64
