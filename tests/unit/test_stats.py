"""Tests of rlcheck.core.stats against a slow, obviously-correct reference written here with plain loops.

The reference implements design.md's definitions per sequence, in float64, one token at a time; the
library computes the same numbers vectorised (segment reductions, expm1, merged sums). Masked-out
tokens do not count; non-finite tokens are put on masked-in tokens only (see
test_masked_nonfinite_is_ignored for the masked case).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.stats import (
    RATIO_LOG_CAP,
    StatsConfig,
    compute,
    compute_partial,
    finalize,
    merge,
)

BIN_RTOL = 0.065  # quantiles come from 1/16-octave bins: within one bin width of np.quantile
EXACT_RTOL = 1e-9


# ---- reference ---------------------------------------------------------------------------------


def _reference_sequences(batch: StepBatch, cfg: StatsConfig) -> list[dict]:
    """Per-sequence facts, one token at a time."""
    lr, lt = batch.logp_rollout.astype(np.float64), batch.logp_train.astype(np.float64)
    mask = np.ones(batch.num_tokens, dtype=bool) if batch.mask is None else batch.mask
    cu = batch.cu_seqlens
    seqs = []
    for i in range(batch.num_sequences):
        ds, first, bad = [], None, False
        for pos, t in enumerate(range(int(cu[i]), int(cu[i + 1]))):
            if not mask[t]:
                continue
            d = float(lt[t]) - float(lr[t])
            if not math.isfinite(d):
                bad = True
                first = pos if first is None else first
                continue
            ds.append(d)
            if abs(d) > cfg.divergence_tau and first is None:
                first = pos
        seq_max = max((abs(d) for d in ds), default=0.0)
        num_cat = sum(1 for d in ds if abs(d) >= cfg.catastrophic_tau)
        catastrophic = num_cat >= cfg.catastrophic_min_tokens and num_cat >= cfg.catastrophic_min_frac * len(ds)
        early = any(abs(float(lt[t]) - float(lr[t])) > cfg.divergence_tau
                    for t in range(int(cu[i]), min(int(cu[i + 1]), int(cu[i]) + cfg.early_window))
                    if mask[t] and math.isfinite(float(lt[t]) - float(lr[t])))
        num_div = sum(1 for d in ds if abs(d) > cfg.divergence_tau)
        catastrophic = catastrophic or (early and num_cat > 0 and num_div >= cfg.catastrophic_min_tokens)
        seqs.append(
            {
                "id": batch.request_ids[i],
                "index": i,
                "d": ds,
                "length": int(cu[i + 1] - cu[i]),
                "max": seq_max,
                "sum": math.fsum(ds),
                "mean": math.fsum(ds) / len(ds) if ds else 0.0,
                "first": first,
                "bad": bad,
                "flagged": bad or seq_max > cfg.divergence_tau,
                "catastrophic": bad or catastrophic,
            }
        )
    return seqs


def _valid_pairs(batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    """(logp_rollout, logp_train) of the tokens that count: masked in and finite d, float64."""
    lr, lt = batch.logp_rollout.astype(np.float64), batch.logp_train.astype(np.float64)
    ok = np.isfinite(lt - lr)
    if batch.mask is not None:
        ok &= batch.mask
    return lr[ok], lt[ok]


def _mean(xs) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs)


def _quantile_range(d: list[float], q: float) -> tuple[float, float]:
    """np.quantile of |d| by linear interpolation and by inverted cdf (what a histogram estimates).

    In a dense sample the two coincide; in a sparse tail adjacent order statistics can be further apart
    than a bin, and either is a correct q-quantile, so the histogram may land within a bin of either."""
    a = np.abs(d)
    lin, inv = float(np.quantile(a, q)), float(np.quantile(a, q, method="inverted_cdf"))
    return min(lin, inv), max(lin, inv)


def reference(batch: StepBatch, cfg: StatsConfig) -> tuple[dict[str, float], list[dict]]:
    """Every metric of design.md, by definition; returns (metrics, offender dicts)."""
    seqs = _reference_sequences(batch, cfg)
    lr_v, lt_v = _valid_pairs(batch)
    d = [float(x) for x in lt_v - lr_v]
    n = len(d)
    mask = np.ones(batch.num_tokens, dtype=bool) if batch.mask is None else batch.mask
    out: dict[str, float] = {
        K.TOKEN_COUNT: n,
        K.TOKEN_MASKED_COUNT: int(np.count_nonzero(~mask)),
        K.NONFINITE_COUNT: int(
            sum(
                1
                for t in range(batch.num_tokens)
                if mask[t] and not math.isfinite(float(batch.logp_train[t]) - float(batch.logp_rollout[t]))
            )
        ),
        K.RATIO_CLIPPED_COUNT: sum(1 for x in d if x > RATIO_LOG_CAP),
    }
    if n:
        r = [math.exp(x) for x in d]
        out.update(
            {
                K.ABS_DIFF_MEAN: _mean(abs(x) for x in d),
                K.ABS_DIFF_CLIPPED_MEAN: _mean(min(abs(x), cfg.clip) for x in d),
                K.CATASTROPHIC_TOKEN_FRAC: sum(1 for x in d if abs(x) >= cfg.catastrophic_tau) / n,
                K.ABS_DIFF_P50: _quantile_range(d, 0.50),
                K.ABS_DIFF_P90: _quantile_range(d, 0.90),
                K.ABS_DIFF_P99: _quantile_range(d, 0.99),
                K.ABS_DIFF_MAX: max(abs(x) for x in d),
                K.DIFF_MEAN: _mean(d),
                K.KL_K1: _mean(-x for x in d),
                K.KL_K2: _mean(x * x / 2 for x in d),
                K.KL_K3: _mean(
                    math.expm1(x) - x for x in d
                ),  # exp(d) - 1 - d, without the rounding of exp(d) - 1
                K.CHI2: _mean(math.expm1(2 * x) for x in d),  # mean(r^2) - 1 = mean(r^2 - 1)
                K.PROB_ABS_DIFF_MEAN: _mean(
                    abs(math.exp(b) - math.exp(a)) for a, b in zip(lr_v, lt_v, strict=True)
                ),
                K.PROB_ABS_DIFF_MAX: max(
                    abs(math.exp(b) - math.exp(a)) for a, b in zip(lr_v, lt_v, strict=True)
                ),
                K.MULT_PROB_ERROR: _mean(math.exp(abs(x)) for x in d),
                K.RATIO_MEAN: _mean(r),
                K.RATIO_STD: float(np.std(r)),
                K.RATIO_MIN: min(r),
                K.RATIO_MAX: max(r),
                K.RATIO_ESS: math.fsum(r) ** 2 / (n * math.fsum(x * x for x in r)),
                K.RATIO_FRAC_ABOVE_C: sum(1 for x in r if x > cfg.ratio_c) / n,
            }
        )
        for t in cfg.thresholds:
            out[K.frac_abs_diff_above(t)] = sum(1 for x in d if abs(x) > t) / n
        out.update(_reference_signatures(batch, cfg, lr_v, d))
        # the residual level: min(|d|, clip) / (1 - p)^0.91 over the tokens with d != 0 and (1 - p)^0.91 >= 1e-3
        res = [min(abs(b - a), cfg.clip) / w for a, b in zip(lr_v, lt_v, strict=True)
               if b != a and (w := (1.0 - math.exp(min(a, 0.0))) ** 0.91) >= 1e-3]
        if res:
            out[K.RESIDUAL_LEVEL] = _mean(res)
    counted = [s for s in seqs if s["d"]]
    num = len(seqs)
    out.update(
        {
            K.SEQ_COUNT: num,
            K.SEQ_EMPTY_COUNT: num - len(counted),
            K.SEQ_FLAGGED_FRAC: sum(s["flagged"] for s in seqs) / num,
            K.SEQ_CATASTROPHIC_COUNT: sum(s["catastrophic"] for s in seqs),
            K.SEQ_CATASTROPHIC_FRAC: sum(s["catastrophic"] for s in seqs) / num,
            K.SIG_EARLY_DIV_COUNT: sum(
                s["catastrophic"] and s["first"] is not None and s["first"] < cfg.early_window for s in seqs
            ),
            K.SIG_EARLY_ANY_COUNT: sum(s["first"] is not None and s["first"] < cfg.early_window for s in seqs),
            K.SIG_EARLY_ANY_EXPECTED: sum(1 for s in seqs for d in s["d"] if abs(d) > cfg.divergence_tau)
            / max(n, 1) * sum(min(len(s["d"]), cfg.early_window) for s in seqs),
        }
    )
    if counted:
        out.update(
            {
                K.SEQ_MAX_ABS_DIFF_MEAN: _mean(s["max"] for s in counted),
                K.SEQ_MAX_ABS_DIFF_MAX: max(s["max"] for s in counted),
                K.SEQ_LOG_RATIO_MEAN: _mean(s["sum"] for s in counted),
                K.SEQ_LOG_RATIO_ABS_MAX: max(abs(s["sum"]) for s in counted),
                K.SEQ_LOG_PPL_DIFF_MEAN: _mean(s["mean"] for s in counted),
                K.SEQ_LOG_PPL_DIFF_ABS_MAX: max(abs(s["mean"]) for s in counted),
            }
        )
    firsts = sorted(s["first"] for s in seqs if s["first"] is not None)
    if firsts:
        out[K.FIRST_DIV_MIN] = firsts[0]
        out[K.FIRST_DIV_P50] = firsts[math.ceil(0.5 * len(firsts)) - 1]  # lower median
    if batch.tokens is not None and batch.tokens_train is not None:
        compared = [t for t in range(batch.num_tokens) if mask[t]]
        mismatch = sum(1 for t in compared if batch.tokens[t] != batch.tokens_train[t])
        out[K.SIG_TOKEN_MISMATCH_COUNT] = mismatch
        out[K.SIG_TOKEN_MISMATCH_FRAC] = mismatch / len(compared)
    score = lambda s: math.inf if s["bad"] else s["max"]  # noqa: E731
    offenders = sorted(seqs, key=lambda s: (-score(s), s["index"]))[: cfg.top_k]
    return out, offenders


def _reference_signatures(batch: StepBatch, cfg: StatsConfig, lr_v: np.ndarray, d: list[float]) -> dict:
    """Slope/correlation of d on logp_rollout, and the shift-by-one fit over leading token pairs."""
    lr_v, d_v = np.asarray(lr_v), np.asarray(d)
    var_lr, var_d = np.var(lr_v), np.var(d_v)
    cov = float(np.mean((d_v - d_v.mean()) * (lr_v - lr_v.mean())))
    out = {
        K.SIG_SLOPE: cov / var_lr if var_lr > 1e-12 else 0.0,
        K.SIG_SLOPE_CORR: cov / math.sqrt(var_lr * var_d) if var_lr * var_d > 1e-24 else 0.0,
    }
    lr, lt = batch.logp_rollout.astype(np.float64), batch.logp_train.astype(np.float64)
    mask = np.ones(batch.num_tokens, dtype=bool) if batch.mask is None else batch.mask
    ok = mask & np.isfinite(lt - lr)
    e0, ep, em = [], [], []
    cu = batch.cu_seqlens
    for i in range(batch.num_sequences):
        a = int(cu[i])
        for j in range(a, min(int(cu[i + 1]), a + cfg.shift_window) - 1):
            if ok[j] and ok[j + 1]:
                e0.append(abs(lt[j] - lr[j]))
                ep.append(abs(lt[j] - lr[j + 1]))  # train[t] vs rollout[t+1]
                em.append(abs(lt[j + 1] - lr[j]))  # train[t+1] vs rollout[t]
    if e0:
        base, p, m = _mean(e0), _mean(ep), _mean(em)
        out.update(
            {
                K.SIG_SHIFT_BASE: base,
                K.SIG_SHIFT_GAIN: base / max(min(p, m), 1e-12),
                K.SIG_SHIFT_DIRECTION: 1.0 if p <= m else -1.0,
            }
        )
    else:
        out.update({K.SIG_SHIFT_BASE: 0.0, K.SIG_SHIFT_GAIN: 0.0, K.SIG_SHIFT_DIRECTION: 0.0})
    return out


QUANTILE_KEYS = (K.ABS_DIFF_P50, K.ABS_DIFF_P90, K.ABS_DIFF_P99)


def assert_matches_reference(
    batch: StepBatch, cfg: StatsConfig, rtol: float = EXACT_RTOL
) -> dict[str, float]:
    """compute() agrees with reference(): same keys, counts exact, floats to rtol, quantiles to a bin."""
    metrics, offenders = compute(batch, cfg)
    want, want_offenders = reference(batch, cfg)
    assert set(metrics) == set(want), set(metrics) ^ set(want)
    for key, ref in want.items():
        if key in QUANTILE_KEYS:
            lo, hi = ref
            assert lo * (1 - BIN_RTOL) - 1e-9 <= metrics[key] <= hi * (1 + BIN_RTOL) + 1e-9, (
                key,
                metrics[key],
                ref,
            )
        elif key.endswith("count") or key in (K.FIRST_DIV_MIN, K.FIRST_DIV_P50, K.SIG_SHIFT_DIRECTION):
            assert metrics[key] == ref, (key, metrics[key], ref)
        else:
            np.testing.assert_allclose(metrics[key], ref, rtol=rtol, atol=1e-300, err_msg=key)
    assert [o.request_id for o in offenders] == [s["id"] for s in want_offenders]
    for o, s in zip(offenders, want_offenders, strict=True):
        assert (o.index, o.first_divergence, o.length, o.nonfinite) == (
            s["index"],
            s["first"],
            s["length"],
            s["bad"],
        )
        np.testing.assert_allclose(
            [o.max_abs_diff, o.mean_diff], [s["max"], s["mean"]], rtol=rtol, atol=1e-15
        )
    assert all(math.isfinite(v) for v in metrics.values())
    return metrics


# ---- batches -----------------------------------------------------------------------------------


def random_batch(
    seed: int = 0, num_sequences: int = 80, nonfinite: bool = True, dtype=np.float64
) -> StepBatch:
    """Noise on every token, some diverged sequences (early and late), mask holes, zero-length and
    fully masked sequences, a few NaN / +-inf tokens, token ids with a few mismatches. All
    sequences are shorter than 64, so first-divergence positions are exact in the histogram."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, num_sequences)
    lens[rng.choice(num_sequences, 6, replace=False)] = 0
    lens[:6] = np.maximum(lens[:6], 10)
    cu = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    m = int(cu[-1])
    lr = -rng.exponential(1.5, m)
    lt = np.minimum(lr + rng.normal(0.0, 0.05, m), 0.0)
    mask = np.ones(m, dtype=bool)
    for i in rng.choice(num_sequences, num_sequences // 4, replace=False):
        if lens[i] >= 6:
            a = cu[i] + rng.integers(1, lens[i] // 2)
            mask[a : a + rng.integers(1, lens[i] // 2)] = False
    mask[cu[5] : cu[6]] = False  # sequence 5: every token masked out
    candidates = np.flatnonzero(lens >= 10)
    for i in rng.choice(candidates[candidates > 5], 12, replace=False):  # diverged sequences
        t = cu[i] + rng.integers(0, lens[i], 3)
        d = rng.choice([-1, 1], 3) * rng.uniform(0.6, 4.0, 3)
        lr[t] = np.minimum(lr[t], -d)  # so that logp_train = logp_rollout + d stays <= 0
        lt[t] = lr[t] + d
        mask[t] = True
    if nonfinite:
        for i, pos, side, value in ((0, 3, "lt", np.nan), (1, 7, "lr", -np.inf), (2, 0, "lt", -np.inf)):
            t = cu[i] + pos
            (lt if side == "lt" else lr)[t] = value
            mask[t] = True
    tokens = rng.integers(0, 1000, m)
    tokens_train = tokens.copy()
    tokens_train[rng.choice(m, 5, replace=False)] += 1
    ids = [f"req-{i:03d}" for i in range(num_sequences)]
    return StepBatch.from_packed(
        lr.astype(dtype), lt.astype(dtype), cu, ids, mask=mask, tokens=tokens, tokens_train=tokens_train
    )


def noise_batch(num_sequences: int, lens, sigma: float = 1e-3, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(logp_rollout, logp_train, cu_seqlens, ids) of numeric noise only."""
    rng = np.random.default_rng(seed)
    lens = np.broadcast_to(np.asarray(lens, dtype=np.int64), (num_sequences,))
    cu = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    lr = -rng.exponential(1.0, int(cu[-1]))
    lt = np.minimum(lr + rng.normal(0.0, sigma, lr.shape[0]), 0.0)
    return lr, lt, cu, [f"req-{i:04d}" for i in range(num_sequences)]


def _packed(lr, lt, cu, ids, **kw) -> StepBatch:
    return StepBatch.from_packed(lr, lt, cu, ids, **kw)


# ---- tests -------------------------------------------------------------------------------------


class TestReferenceAgreement:
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_random_batch(self, seed):
        """Every metric and every offender of a messy float64 batch matches the reference."""
        metrics = assert_matches_reference(random_batch(seed), StatsConfig())
        assert metrics[K.SEQ_EMPTY_COUNT] >= 7 and metrics[K.NONFINITE_COUNT] == 3
        assert metrics[K.TOKEN_MASKED_COUNT] > 0 and metrics[K.SIG_TOKEN_MISMATCH_COUNT] >= 1

    def test_random_batch_without_nonfinite(self):
        """The same holds without non-finite tokens (the fast path that skips the finiteness mask)."""
        assert_matches_reference(random_batch(3, nonfinite=False), StatsConfig())

    def test_no_mask(self):
        """Without a mask every token counts; the reference agrees."""
        lr, lt, cu, ids = noise_batch(40, np.arange(40) % 13, sigma=0.3, seed=4)
        assert_matches_reference(_packed(lr, lt, cu, ids), StatsConfig())

    def test_other_config(self):
        """Non-default thresholds, taus, ratio_c, top_k and shift window are all honoured."""
        cfg = StatsConfig(
            thresholds=(0.02, 0.2, 3.0),
            divergence_tau=0.1,
            catastrophic_tau=1.0,
            early_window=10,
            ratio_c=1.05,
            top_k=25,
            shift_window=5,
        )
        metrics = assert_matches_reference(random_batch(5), cfg)
        assert K.frac_abs_diff_above(0.02) in metrics

    def test_offenders_all_sequences(self):
        """With top_k above the batch size, every sequence is ranked, empty ones last by index."""
        batch = random_batch(6)
        _, offenders = compute(batch, StatsConfig(top_k=1000))
        assert len(offenders) == batch.num_sequences
        assert sorted(o.index for o in offenders) == list(range(batch.num_sequences))

    @pytest.mark.parametrize("num_sequences", [11, 12, 40, 200])
    def test_offender_ties_break_by_index(self, num_sequences):
        """Sequences with equal max |d| are ranked by batch index, also across the top-K boundary."""
        lens = np.full(num_sequences, 3)
        cu = np.zeros(num_sequences + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        lr = np.full(int(cu[-1]), -1.0)
        lt = lr - 0.25
        lt[cu[7]] = -3.0  # one clear worst sequence
        _, offenders = compute(_packed(lr, lt, cu, [str(i) for i in range(num_sequences)]))
        assert [o.index for o in offenders] == [7, 0, 1, 2, 3, 4, 5, 6, 8, 9]


class TestFloat32:
    def _pair(self, batch32: StepBatch) -> tuple[StepBatch, StepBatch]:
        batch64 = StepBatch.from_packed(
            batch32.logp_rollout.astype(np.float64),
            batch32.logp_train.astype(np.float64),
            batch32.cu_seqlens,
            batch32.request_ids,
            mask=batch32.mask,
            tokens=batch32.tokens,
            tokens_train=batch32.tokens_train,
        )
        return batch32, batch64

    def _assert_close(self, batch32: StepBatch, batch64: StepBatch, cfg: StatsConfig = StatsConfig()) -> None:
        # kl_k3 = mean(expm1(d)) - mean(d): the two sums agree to ~|d|/2 relative, so float32's rounding of
        # expm1(d) (relative 6e-8, absolute 6e-8 |d|) becomes ~1e-7 / (|d|/2) of kl_k3: ~1e-4 at |d| ~ 1e-3.
        # prob_abs_diff_max: exp(lt) - exp(lr) cancels in float32 (see test_prob_abs_diff_precision).
        loose = {K.KL_K3: 1e-3, K.PROB_ABS_DIFF_MAX: 1e-4}
        got, got_off = compute(batch32, cfg)
        want, want_off = compute(batch64, cfg)
        assert set(got) == set(want)
        for key, ref in want.items():
            rtol = loose.get(key, 1e-5)
            np.testing.assert_allclose(got[key], ref, rtol=rtol, atol=1e-12, err_msg=key)
        assert [o.request_id for o in got_off] == [o.request_id for o in want_off]

    def test_noise_batch(self):
        """A large float32 noise batch gives the float64 metrics of the same values within 1e-5."""
        lr, lt, cu, ids = noise_batch(500, 200, seed=7)
        self._assert_close(*self._pair(_packed(lr.astype(np.float32), lt.astype(np.float32), cu, ids)))

    def test_random_batch(self):
        """The messy batch (mask holes, NaN, divergences) agrees between float32 and float64."""
        self._assert_close(*self._pair(random_batch(8, dtype=np.float32)))

    def test_skewed_batch(self, make_skewed_batch):
        """The shared skewed batch (heavy-tailed lengths, d = -12, NaN) agrees between the dtypes."""
        self._assert_close(*self._pair(make_skewed_batch(np.float32, extreme=False)))

    def test_prob_abs_diff_precision(self):
        """prob_abs_diff of near-certain tokens (p ~ 0.99, d ~ 1e-5) in float32 is within 1e-5 of float64."""
        rng = np.random.default_rng(25)
        lr = -rng.uniform(0.005, 0.02, 1000).astype(np.float32)
        lt = (lr + rng.normal(0.0, 1e-5, 1000).astype(np.float32)).clip(max=0.0)
        batch32, batch64 = self._pair(_packed(lr, lt, [0, 500, 1000], ["a", "b"]))
        got, want = compute(batch32)[0], compute(batch64)[0]
        for key in (K.PROB_ABS_DIFF_MEAN, K.PROB_ABS_DIFF_MAX):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)

    def test_large_d_switches_to_float64(self):
        """|d| = 30 in float32 input (past the float32-safe range) matches the float64 input."""
        lr, lt, cu, ids = noise_batch(50, 40, seed=9)
        lr[100], lt[100] = -30.5, -0.5  # exact in float32: d = +30 exactly
        lr[700], lt[700] = -0.25, -30.25  # d = -30
        batch32, batch64 = self._pair(_packed(lr.astype(np.float32), lt.astype(np.float32), cu, ids))
        self._assert_close(batch32, batch64)
        np.testing.assert_allclose(compute(batch32)[0][K.RATIO_MAX], math.exp(30.0), rtol=1e-12)


class TestNumericSafety:
    @pytest.mark.parametrize("dtype", [np.float64, np.float32])
    def test_ratio_cap(self, dtype):
        """d = +200 on one token: ratio capped at e^50, counted once, no inf or NaN anywhere."""
        lr, lt, cu, ids = noise_batch(20, 30, seed=10)
        lr[45], lt[45] = -250.0, -50.0
        metrics, offenders = compute(_packed(lr.astype(dtype), lt.astype(dtype), cu, ids))
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics[K.RATIO_CLIPPED_COUNT] == 1
        assert metrics[K.RATIO_MAX] == math.exp(RATIO_LOG_CAP)
        assert metrics[K.ABS_DIFF_MAX] == 200.0  # |d| itself is not capped
        assert offenders[0].index == 1 and offenders[0].max_abs_diff == 200.0
        assert all(math.isfinite(getattr(o, f)) for o in offenders for f in ("max_abs_diff", "mean_diff"))

    @pytest.mark.parametrize("dtype", [np.float64, np.float32])
    def test_large_negative_d(self, dtype):
        """d = -300: the ratio minimum is finite and >= 0, every metric finite."""
        lr, lt, cu, ids = noise_batch(20, 30, seed=11)
        lr[10], lt[10] = -1.0, -301.0
        metrics, _ = compute(_packed(lr.astype(dtype), lt.astype(dtype), cu, ids))
        assert all(math.isfinite(v) for v in metrics.values())
        assert 0.0 <= metrics[K.RATIO_MIN] <= math.exp(-299.0)
        assert metrics[K.RATIO_CLIPPED_COUNT] == 0

    def test_tiny_d_no_cancellation(self):
        """d ~ 1e-7: kl_k3 equals mean(d^2/2) to 1e-3 (exp(d) - 1 - d computed naively would be noise)."""
        rng = np.random.default_rng(12)
        lr = -rng.uniform(0.1, 3.0, 20_000)
        lt = lr + rng.choice([-1.0, 1.0], lr.shape[0]) * rng.uniform(0.5e-7, 2e-7, lr.shape[0])
        cu = np.array([0, 5000, 12_000, 20_000])
        metrics, _ = compute(_packed(lr, lt, cu, ["a", "b", "c"]))
        d = lt - lr
        k2 = float(np.mean(d * d / 2))
        np.testing.assert_allclose(metrics[K.KL_K3], k2, rtol=1e-3)
        np.testing.assert_allclose(metrics[K.KL_K2], k2, rtol=1e-9)

    def test_tiny_d_single_token(self):
        """One token with d = 1e-7: kl_k3 = d^2/2 + d^3/6 to 1e-6 (np.exp(d) - 1 - d is ~1e-3 off here)."""
        batch = _packed(np.array([-1.0]), np.array([-1.0 + 1e-7]), [0, 1], ["a"])
        d = float(batch.logp_train[0] - batch.logp_rollout[0])
        np.testing.assert_allclose(compute(batch)[0][K.KL_K3], d * d / 2 + d**3 / 6, rtol=1e-6)

    def test_nonfinite_tokens(self):
        """NaN and +-inf tokens are left out of every statistic, counted, and rank their sequences first."""
        lr, lt, cu, ids = noise_batch(6, 10, sigma=0.01, seed=13)
        lt[cu[1] + 3] = np.nan  # seq 1, position 3
        lr[cu[2] + 5] = -np.inf  # seq 2, position 5: d = +inf
        lt[cu[3] + 0] = -np.inf  # seq 3, position 0: d = -inf
        lr[cu[4] + 2 : cu[4] + 5], lt[cu[4] + 2 : cu[4] + 5] = -0.5, -6.0  # seq 4: finite catastrophic (3 of 10)
        batch = _packed(lr, lt, cu, ids)
        metrics = assert_matches_reference(batch, StatsConfig())
        _, offenders = compute(batch)
        assert [(o.index, o.nonfinite, o.first_divergence) for o in offenders[:4]] == [
            (1, True, 3),
            (2, True, 5),
            (3, True, 0),
            (4, False, 2),
        ]
        assert metrics[K.NONFINITE_COUNT] == 3 and metrics[K.TOKEN_COUNT] == 57
        assert metrics[K.SEQ_CATASTROPHIC_COUNT] == 4 and metrics[K.SEQ_FLAGGED_FRAC] == 4 / 6
        assert metrics[K.ABS_DIFF_MAX] == 5.5 and metrics[K.FIRST_DIV_MIN] == 0
        assert all(math.isfinite(v) for v in metrics.values())

    def test_all_tokens_nonfinite(self):
        """A batch of only non-finite tokens reports counts but no token metrics, and no NaN."""
        lr = np.array([np.nan, -1.0, -np.inf, -2.0])
        lt = np.array([-1.0, np.nan, -1.0, -np.inf])
        metrics, offenders = compute(_packed(lr, lt, [0, 2, 4], ["a", "b"]))
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics[K.TOKEN_COUNT] == 0 and metrics[K.NONFINITE_COUNT] == 4
        assert metrics[K.SEQ_CATASTROPHIC_COUNT] == 2 and metrics[K.SEQ_EMPTY_COUNT] == 2
        for key in (K.ABS_DIFF_MEAN, K.KL_K3, K.RATIO_MEAN, K.SIG_SLOPE, K.SEQ_MAX_ABS_DIFF_MEAN):
            assert key not in metrics, key
        assert [o.request_id for o in offenders] == ["a", "b"] and all(o.nonfinite for o in offenders)

    def test_masked_nonfinite_is_ignored(self):
        """A NaN on a masked-out token does not count: the mask says which tokens count."""
        lr = np.array([-1.0, np.nan, -1.0, -1.0, -2.0])
        lt = np.array([-1.0, -1.0, -1.0, -1.0, -2.0])
        metrics, offenders = compute(
            _packed(lr, lt, [0, 3, 5], ["a", "b"], mask=np.array([1, 0, 1, 1, 1], bool))
        )
        assert metrics[K.NONFINITE_COUNT] == 0
        assert metrics[K.SEQ_CATASTROPHIC_COUNT] == 0 and not offenders[0].nonfinite


class TestInvariance:
    def test_permutation(self):
        """Reordering sequences changes no metric, and offenders name the same requests."""
        batch = random_batch(14)
        perm = np.random.default_rng(14).permutation(batch.num_sequences)
        cfg = StatsConfig(top_k=1000)
        (m1, o1), (m2, o2) = compute(batch, cfg), compute(batch.select(perm), cfg)
        assert m1.keys() == m2.keys()
        for key in m1:
            np.testing.assert_allclose(m2[key], m1[key], rtol=1e-12, atol=1e-15, err_msg=key)
        by_id = {o.request_id: o for o in o1}
        for o in o2:
            ref = by_id[o.request_id]
            assert perm[o.index] == ref.index
            assert (o.max_abs_diff, o.first_divergence, o.length, o.nonfinite) == (
                ref.max_abs_diff,
                ref.first_divergence,
                ref.length,
                ref.nonfinite,
            )

    def test_permutation_default_top_k(self):
        """With the default top_k, the same requests are the offenders after a reordering."""
        batch = random_batch(15, nonfinite=False)
        perm = np.random.default_rng(15).permutation(batch.num_sequences)
        o1, o2 = compute(batch)[1], compute(batch.select(perm))[1]
        assert [o.request_id for o in o2] == [o.request_id for o in o1]


class TestSparseCatastrophe:
    def test_one_bad_sequence_in_a_thousand(self):
        """One sequence 2.5-4 nats off on every token is found at once, while mean-based gates miss it."""
        rng = np.random.default_rng(16)
        lens = rng.integers(50, 151, 1000)
        bad = 613
        lens[bad] = 100
        lr, lt, cu, ids = noise_batch(1000, lens, seed=16)
        clean = compute(_packed(lr, lt, cu, ids))[0]
        span = slice(cu[bad], cu[bad + 1])
        lt[span] = lr[span] - rng.uniform(2.5, 4.0, 100)
        metrics, offenders = compute(_packed(lr, lt, cu, ids))

        assert offenders[0].request_id == ids[bad] and offenders[0].index == bad
        assert offenders[0].first_divergence == 0
        assert offenders[1].max_abs_diff < 0.01
        assert metrics[K.SEQ_CATASTROPHIC_COUNT] == 1
        assert metrics[K.SIG_EARLY_DIV_COUNT] == 1
        assert metrics[K.FIRST_DIV_MIN] == 0
        # What a mean-based gate sees: barely anything.
        assert abs(metrics[K.ABS_DIFF_MEAN] - clean[K.ABS_DIFF_MEAN]) < 0.01
        assert metrics[K.MULT_PROB_ERROR] < 1.05  # NeMo-RL's default gate would not fire
        assert metrics[K.ABS_DIFF_P99] < 0.01


def _temperature_batch(temperature: float, seed: int = 17) -> StepBatch:
    """Rollout at `temperature` (log_softmax(z / T)), trainer at T = 1, over a 50-token vocabulary."""
    rng = np.random.default_rng(seed)
    num_sequences, length, vocab = 100, 30, 50
    z = rng.normal(0.0, 2.0, (num_sequences * length, vocab))

    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    lp_rollout = log_softmax(z / temperature)
    rows = np.arange(z.shape[0])
    tok = np.array([rng.choice(vocab, p=np.exp(p)) for p in lp_rollout])  # sampled by the engine
    lr = lp_rollout[rows, tok]
    lt = log_softmax(z)[rows, tok]
    cu = np.arange(0, num_sequences * length + 1, length)
    return _packed(lr, lt, cu, [f"r{i}" for i in range(num_sequences)], tokens=tok, tokens_train=tok)


def _shifted_batch(shift: int, seed: int = 18) -> StepBatch:
    """logp_train[t] is the true logprob of token t + shift of the same sequence (0: aligned)."""
    rng = np.random.default_rng(seed)
    num_sequences, length = 50, 40
    lr_parts, lt_parts = [], []
    for _ in range(num_sequences):
        true = -rng.exponential(1.5, length)
        lr_parts.append(true)
        lt = np.roll(true, -shift) if shift else true.copy()
        lt_parts.append(np.minimum(lt + rng.normal(0.0, 1e-3, length), 0.0))
    return StepBatch.from_ragged(lr_parts, lt_parts, [f"r{i}" for i in range(num_sequences)])


class TestSignatures:
    def test_temperature_mismatch_correlates(self):
        """A temperature mismatch (T = 0.7) makes d strongly correlated with logp_rollout."""
        metrics, _ = compute(_temperature_batch(0.7))
        assert abs(metrics[K.SIG_SLOPE_CORR]) > 0.5
        assert metrics[K.SIG_SLOPE] != 0.0

    def test_temperature_one_has_no_slope(self):
        """Same logits at T = 1 on both sides: no mismatch, correlation 0."""
        metrics, _ = compute(_temperature_batch(1.0))
        assert metrics[K.ABS_DIFF_MAX] < 1e-12
        assert abs(metrics[K.SIG_SLOPE_CORR]) < 0.2

    def test_noise_has_no_slope(self):
        """Numeric noise alone leaves |corr(d, logp_rollout)| small."""
        lr, lt, cu, ids = noise_batch(100, 50, seed=19)
        metrics, _ = compute(_packed(lr, lt, cu, ids))
        assert abs(metrics[K.SIG_SLOPE_CORR]) < 0.2

    def test_shift_forward(self):
        """logp_train[t] = logp of token t+1: shift gain > 3, direction +1."""
        metrics, _ = compute(_shifted_batch(+1))
        assert metrics[K.SIG_SHIFT_GAIN] > 3
        assert metrics[K.SIG_SHIFT_DIRECTION] == 1.0

    def test_shift_backward(self):
        """logp_train[t] = logp of token t-1: shift gain > 3, direction -1."""
        metrics, _ = compute(_shifted_batch(-1))
        assert metrics[K.SIG_SHIFT_GAIN] > 3
        assert metrics[K.SIG_SHIFT_DIRECTION] == -1.0

    def test_aligned_has_no_shift(self):
        """Aligned data: shifting only makes the fit worse (gain < 1)."""
        metrics, _ = compute(_shifted_batch(0))
        assert metrics[K.SIG_SHIFT_GAIN] < 1

    def test_token_mismatch_count(self):
        """Three differing token ids on counted tokens give token_mismatch_count == 3; masked ones don't count."""
        lr, lt, cu, ids = noise_batch(4, 25, seed=20)
        tokens = np.arange(100)
        tokens_train = tokens.copy()
        tokens_train[[3, 40, 77]] += 1
        tokens_train[90] += 1  # masked out below
        mask = np.ones(100, dtype=bool)
        mask[90] = False
        metrics, _ = compute(_packed(lr, lt, cu, ids, mask=mask, tokens=tokens, tokens_train=tokens_train))
        assert metrics[K.SIG_TOKEN_MISMATCH_COUNT] == 3
        assert metrics[K.SIG_TOKEN_MISMATCH_FRAC] == 3 / 99

    def test_no_token_ids_no_mismatch_metric(self):
        """Without both token arrays the token-mismatch metrics are absent (not a fake 0)."""
        lr, lt, cu, ids = noise_batch(4, 25, seed=21)
        metrics, _ = compute(_packed(lr, lt, cu, ids, tokens=np.arange(100)))
        assert K.SIG_TOKEN_MISMATCH_COUNT not in metrics


class TestStatsConfig:
    def test_defaults_valid(self):
        """The defaults construct without error."""
        cfg = StatsConfig()
        assert cfg.catastrophic_tau > cfg.divergence_tau > 0 and cfg.ratio_c > 1

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"thresholds": (0.1, -0.5)},
            {"thresholds": (0.0,)},
            {"thresholds": (math.inf,)},
            {"thresholds": (math.nan,)},
            {"divergence_tau": -0.5},
            {"divergence_tau": 0.0},
            {"divergence_tau": math.nan},
            {"catastrophic_tau": -2.0},
            {"ratio_c": 1.0},
            {"ratio_c": 0.5},
            {"ratio_c": math.nan},
            {"top_k": 0},
            {"early_window": 0},
            {"shift_window": 0},
        ],
    )
    def test_bad_values(self, kwargs):
        """Out-of-range values raise ValueError naming the field."""
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            StatsConfig(**kwargs)


class TestMerge:
    def _parts(self, batch: StepBatch, bounds, cfg: StatsConfig):
        edges = [0, *bounds, batch.num_sequences]
        return [
            compute_partial(batch.select(np.arange(a, b)), cfg)
            for a, b in zip(edges[:-1], edges[1:], strict=True)
        ]

    @pytest.mark.parametrize("seed", [0, 1])
    def test_three_uneven_parts(self, seed, assert_stats_equal):
        """Merging three uneven parts reproduces compute() of the whole batch."""
        batch, cfg = random_batch(seed), StatsConfig()
        merged = merge(self._parts(batch, (7, 50), cfg), top_k=cfg.top_k)
        assert_stats_equal(finalize(merged, cfg), compute(batch, cfg), 1e-9)

    def test_skewed_batch(self, make_skewed_batch, assert_stats_equal):
        """The shared skewed batch merged from three uneven parts equals the whole."""
        batch, cfg = make_skewed_batch(), StatsConfig()
        merged = merge(self._parts(batch, (11, 190), cfg), top_k=cfg.top_k)
        assert_stats_equal(finalize(merged, cfg), compute(batch, cfg), 1e-9)

    def test_offender_indices_offset(self):
        """Offenders of later parts get indices counted from the start of the combined batch."""
        lr, lt, cu, ids = noise_batch(30, 10, seed=22)
        for seq, d in ((2, -1.0), (13, -3.0), (27, -2.0)):
            lt[cu[seq]] = lr[cu[seq]] + d
        batch, cfg = _packed(lr, lt, cu, ids), StatsConfig(top_k=3)
        parts = self._parts(batch, (5, 20), cfg)
        assert [o.index for o in parts[1].offenders][0] == 8 and [o.index for o in parts[2].offenders][0] == 7
        offenders = finalize(merge(parts), cfg)[1]
        assert [(o.index, o.request_id) for o in offenders] == [(13, ids[13]), (27, ids[27]), (2, ids[2])]

    def test_small_parts_keep_top_k(self, assert_stats_equal):
        """Parts smaller than top_k still merge into top_k offenders, as compute() of the whole gives."""
        lr, lt, cu, ids = noise_batch(12, 5, sigma=0.1, seed=23)
        batch, cfg = _packed(lr, lt, cu, ids), StatsConfig()
        merged = merge(self._parts(batch, (4, 8), cfg))
        assert_stats_equal(finalize(merged, cfg), compute(batch, cfg), 1e-9)

    def test_merge_of_one_part(self, assert_stats_equal):
        """merge() of a single part is the identity."""
        batch, cfg = random_batch(24), StatsConfig()
        assert_stats_equal(finalize(merge([compute_partial(batch, cfg)]), cfg), compute(batch, cfg), 0.0)

    def test_merge_nothing(self):
        """merge([]) is an error, not an empty result."""
        with pytest.raises(ValueError):
            merge([])
