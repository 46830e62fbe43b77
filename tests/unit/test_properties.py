"""Property tests (hypothesis) of the data contract and the statistics: no NaN from finite input,
no dependence on sequence order or on how sequences are split over ranks, and one batch whichever
constructor built it.

Hypothesis draws the structure (sequence lengths, masks, dtype, padding side, permutation, split
point) and a seed; numpy draws the token values from a mixture that always holds the awkward ones:
exact 0, -30, tiny magnitudes, the -1e4 sentinel edge from both sides, tiny and large |d|, and
batches where every ratio r = exp(d) is far below 1. A longer hunt than the default 100 examples:

    RLCHECK_PROPERTY_EXAMPLES=4000 pytest tests/unit/test_properties.py
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import HaltConfig, Monitor, MonitorConfig
from rlcheck.core.stats import (
    MIN_LOGPROB,
    PartialStats,
    StatsConfig,
    compute,
    compute_partial,
    finalize,
    merge,
)

EXAMPLES = int(os.environ.get("RLCHECK_PROPERTY_EXAMPLES", "100"))
FAST = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
REL = 1e-9  # float64 input: sums differ only in the order of float64 additions
REL_F32 = 1e-5  # float32 input: a rank whose |d| stays below 20 keeps float32 products (stats.partial)


@dataclass
class Case:
    """A drawn batch as plain arrays: sequence i is tokens cu[i]:cu[i+1]."""

    lens: list[int]
    lr: np.ndarray  # (M,)
    lt: np.ndarray  # (M,)
    mask: np.ndarray | None  # (M,) bool
    tokens: np.ndarray  # (M,) int64
    tokens_train: np.ndarray  # (M,) int64

    @property
    def cu(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int64)

    @property
    def ids(self) -> list[str]:
        return [f"req-{i}" for i in range(len(self.lens))]

    def ragged(self, name: str) -> list[np.ndarray] | None:
        a, cu = getattr(self, name), self.cu
        return None if a is None else [a[cu[i] : cu[i + 1]] for i in range(len(self.lens))]

    def packed(self) -> StepBatch:
        return StepBatch.from_packed(self.lr, self.lt, self.cu, self.ids, mask=self.mask,
                                     tokens=self.tokens, tokens_train=self.tokens_train)


def _logprobs(rng: np.random.Generator, m: int) -> np.ndarray:
    """(M,) float64 rollout logprobs: uniform on [-30, 0] mixed with exact 0, exact -30, tiny
    magnitudes and the MIN_LOGPROB sentinel edge (exactly, a hair above, a hair below)."""
    lr = -30.0 * rng.random(m)
    kind = rng.choice(7, size=m, p=[0.6, 0.08, 0.06, 0.1, 0.06, 0.05, 0.05])
    lr[kind == 1] = 0.0
    lr[kind == 2] = -30.0
    lr[kind == 3] = -(10.0 ** rng.uniform(-300, -1, np.count_nonzero(kind == 3)))
    lr[kind == 4] = MIN_LOGPROB
    lr[kind == 5] = MIN_LOGPROB + 0.01
    lr[kind == 6] = MIN_LOGPROB - 0.01  # a sentinel: counted as non-finite
    return lr


def _diffs(rng: np.random.Generator, m: int) -> np.ndarray:
    """(M,) d: exact 0, tiny (1e-300..1e-6), noise (sigma 0.05) and large (2..70, past the ratio cap)."""
    sign = rng.choice([-1.0, 1.0], size=m)
    d = rng.normal(0.0, 0.05, m)
    kind = rng.choice(4, size=m, p=[0.15, 0.15, 0.6, 0.1])
    d[kind == 0] = 0.0
    d[kind == 1] = sign[kind == 1] * 10.0 ** rng.uniform(-300, -6, np.count_nonzero(kind == 1))
    d[kind == 3] = sign[kind == 3] * rng.uniform(2.0, 70.0, np.count_nonzero(kind == 3))
    return d


@st.composite
def cases(draw, *, edge_tokens_in: bool = False, nonfinite: bool = True) -> Case:
    """A batch of 1..40 sequences of 0..64 tokens (at least one token); `edge_tokens_in` keeps the
    first and last token of every sequence in the mask (what `from_padded` needs to keep lengths)."""
    lens = draw(st.lists(st.integers(0, 64), min_size=1, max_size=40).filter(lambda ls: sum(ls) > 0))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    m = sum(lens)
    if draw(st.booleans()):
        lr = _logprobs(rng, m)
    else:  # one value, or within 1e-6 of it: variances of logp_rollout at 0 or at rounding noise
        lr = draw(st.sampled_from([-1e-9, -3.0, -9999.0])) - rng.uniform(0, draw(st.sampled_from([0.0, 1e-6])), m)
    shift = draw(st.sampled_from([0.0, 0.0, -45.0, -400.0]))  # every r below 1e-19: 1 + (r - 1) cancels
    lt = np.minimum(lr + _diffs(rng, m) + shift, 0.0)
    if nonfinite and draw(st.booleans()):  # a few NaN / -inf tokens on either side
        bad = rng.random(m) < 0.03
        side = rng.random(m) < 0.5
        lr[bad & side], lt[bad & ~side] = np.nan, -np.inf
    mask = None
    if draw(st.booleans()):
        mask = rng.random(m) < draw(st.sampled_from([0.3, 0.8, 0.97]))
        mask[rng.integers(m)] = True
        if edge_tokens_in:
            cu = np.concatenate([[0], np.cumsum(lens)])
            nonempty = np.diff(cu) > 0
            mask[cu[:-1][nonempty]] = mask[cu[1:][nonempty] - 1] = True
    tokens = rng.integers(0, 1000, m)
    tokens_train = np.where(rng.random(m) < 0.05, rng.integers(0, 1000, m), tokens)
    return Case(lens, lr.astype(dtype), lt.astype(dtype), mask, tokens, tokens_train)


def _informative(case) -> bool:
    """A valid token with d != 0 that healthy noise would move ((1 - p)^0.91 >= 1e-3): the residual level's."""
    ok = (case.lr >= MIN_LOGPROB) & (case.lt >= MIN_LOGPROB) & (case.lt != case.lr)
    ok &= (1.0 - np.exp(np.minimum(case.lr, 0.0))) ** 0.91 >= 1e-3
    return bool((ok if case.mask is None else ok & case.mask).any())


def _expected_keys(metrics: dict[str, float], cfg: StatsConfig, has_tokens: bool, informative: bool = False) -> set[str]:
    """The documented key set (rlcheck.core.stats.finalize): a metric that is undefined is absent."""
    always = {K.TOKEN_COUNT, K.TOKEN_MASKED_COUNT, K.NONFINITE_COUNT, K.RATIO_CLIPPED_COUNT, K.SEQ_COUNT,
              K.SEQ_EMPTY_COUNT, K.SEQ_FLAGGED_FRAC, K.SEQ_CATASTROPHIC_COUNT, K.SEQ_CATASTROPHIC_FRAC,
              K.SIG_EARLY_DIV_COUNT, K.SIG_EARLY_ANY_COUNT, K.SIG_EARLY_ANY_EXPECTED}
    seq_keys = {K.SEQ_MAX_ABS_DIFF_MEAN, K.SEQ_MAX_ABS_DIFF_MAX, K.SEQ_LOG_RATIO_MEAN,
                K.SEQ_LOG_RATIO_ABS_MAX, K.SEQ_LOG_PPL_DIFF_MEAN, K.SEQ_LOG_PPL_DIFF_ABS_MAX}
    token_keys = set(K.ALWAYS) - always - seq_keys | {K.frac_abs_diff_above(t) for t in cfg.thresholds}
    keys = set(always)
    if metrics[K.TOKEN_COUNT] > 0:  # some valid token: token metrics, and a sequence that holds it
        keys |= token_keys | seq_keys
    if has_tokens:  # token ids on both sides: the mismatch count over the unmasked tokens
        keys |= {K.SIG_TOKEN_MISMATCH_COUNT, K.SIG_TOKEN_MISMATCH_FRAC}
    if metrics[K.SEQ_FLAGGED_FRAC] > 0:  # a sequence diverged (or holds a non-finite token)
        keys |= {K.FIRST_DIV_MIN, K.FIRST_DIV_P50}
    if informative:  # rlcheck.core.stats.residual
        keys |= {K.RESIDUAL_LEVEL}
    return keys


def _one_pass_tolerances(p: PartialStats, mom: float) -> dict[str, float]:
    """Absolute tolerances of the metrics built on one-pass variances E[x^2] - E[x]^2: the moments
    are known to `mom` relative, which the subtraction amplifies by E[x^2] / var."""
    s, n = p.sums, p.sums["n"]
    m_d, m_lr = s["d"] / n, s["lr"] / n
    var_lr, var_d = s["lr2"] / n - m_lr * m_lr, s["d2"] / n - m_d * m_d
    cov = s["dlr"] / n - m_d * m_lr
    e_cov, e_lr, e_d = (mom * x for x in (abs(s["dlr"] / n) + abs(m_d * m_lr), s["lr2"] / n, s["d2"] / n))
    if var_lr <= 10 * max(1e-12, 1e-10 * s["lr2"] / n) or var_d <= 10 * 1e-10 * s["d2"] / n or var_lr * var_d <= 1e-23:
        slope = corr = math.inf  # at the edge of finalize's resolution guard: 0 on either side is fine
    else:
        slope = e_cov / var_lr + abs(cov) * e_lr / var_lr**2
        corr = (e_cov + abs(cov) * (e_lr / var_lr + e_d / var_d)) / math.sqrt(var_lr * var_d)
    e2 = min(s["e2"], s["r2"]) / n  # the second moment finalize took var r from
    return {K.SIG_SLOPE: slope, K.SIG_SLOPE_CORR: corr, K.RATIO_STD: math.sqrt(mom * e2)}


def assert_metrics_close(got: dict[str, float], want: dict[str, float], p: PartialStats, float32: bool = False) -> None:
    """Same keys; every value equal up to float rounding: relative 1e-9 (float32 ranks: 1e-5), and
    for the one-pass variances that rounding times their conditioning; the shift direction, a
    decision between two sums of `p`, may differ only where those sums tie up to rounding."""
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    rel = REL_F32 if float32 else REL
    extra = _one_pass_tolerances(p, 1e-6 if float32 else 1e-13) if want[K.TOKEN_COUNT] > 0 else {}
    for key, w in want.items():
        if key == K.SIG_SHIFT_DIRECTION and got[key] != w:
            assert math.isclose(p.sums["sh_ep"], p.sums["sh_em"], rel_tol=rel), (p.sums["sh_ep"], p.sums["sh_em"])
            continue
        assert math.isclose(got[key], w, rel_tol=rel, abs_tol=max(1e-12, extra.get(key, 0.0))), (key, got[key], w)


def assert_same_offenders(got, want) -> None:
    """Same scores in the same order; the same request ids above the last kept score (ties at the
    top-K edge may name different sequences); same per-request fields."""
    assert [o.score for o in got] == [o.score for o in want]
    edge = want[-1].score if want else math.inf
    assert {o.request_id for o in got if o.score > edge} == {o.request_id for o in want if o.score > edge}
    by_id = {o.request_id: o for o in want}
    for o in got:
        if o.request_id in by_id:
            w = by_id[o.request_id]
            assert (o.max_abs_diff, o.first_divergence, o.length, o.nonfinite) == (
                w.max_abs_diff, w.first_divergence, w.length, w.nonfinite)
            assert math.isclose(o.mean_diff, w.mean_diff, rel_tol=REL, abs_tol=1e-12)


class TestFiniteMetrics:
    @FAST
    @given(cases(), st.booleans())
    def test_every_metric_finite(self, case, with_tokens):
        """Every metric of any batch (sentinels, NaN, -inf included) is finite; undefined ones are absent."""
        batch = case.packed() if with_tokens else StepBatch.from_packed(case.lr, case.lt, case.cu, case.ids, mask=case.mask)
        cfg = StatsConfig()
        metrics, offenders = compute(batch, cfg)
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad
        assert metrics.keys() == _expected_keys(metrics, cfg, with_tokens, _informative(case))
        assert all(math.isfinite(o.max_abs_diff) and math.isfinite(o.mean_diff) for o in offenders)

    def test_all_ratios_far_below_one(self):
        """Every d near -45 (r ~ 1e-20, where 1 + (r - 1) rounds to 0) gives ESS 1 and ratio mean r, not 0 / 0."""
        lr = np.array([-1.0, -2.0, -3.0])
        metrics, _ = compute(StepBatch.from_packed(lr, lr - 45.0, [0, 3], ["a"]))
        assert math.isclose(metrics[K.RATIO_ESS], 1.0, rel_tol=1e-12)
        assert math.isclose(metrics[K.RATIO_MEAN], math.exp(-45.0), rel_tol=1e-12)
        assert metrics[K.RATIO_STD] < 1e-30

    @settings(max_examples=max(10, EXAMPLES // 4), deadline=None, database=None)
    @given(cases())
    def test_monitor_report_finite(self, case):
        """Monitor.observe reports only finite metrics (halting off, no sinks)."""
        with tempfile.TemporaryDirectory() as run_dir:
            mon = Monitor(MonitorConfig(run_dir=run_dir, sinks=(), halt=HaltConfig(enabled=False)))
            with mon:
                report = mon.observe(0, case.packed())
        assert all(math.isfinite(v) for v in report.metrics.values())


class TestPermutation:
    @FAST
    @given(st.data())
    def test_sequence_order_changes_nothing(self, data):
        """Reordering the sequences changes no metric, and the offenders are the same requests."""
        case = data.draw(cases())
        perm = data.draw(st.permutations(range(len(case.lens))))
        cfg = StatsConfig(top_k=data.draw(st.integers(1, len(case.lens) + 2)))
        ids = case.ids
        shuffled = StepBatch.from_ragged(
            [case.ragged("lr")[i] for i in perm], [case.ragged("lt")[i] for i in perm], [ids[i] for i in perm],
            [case.ragged("tokens")[i] for i in perm], tokens_train=[case.ragged("tokens_train")[i] for i in perm],
            mask=None if case.mask is None else [case.ragged("mask")[i] for i in perm],
        )
        p1 = compute_partial(case.packed(), cfg)
        (m1, o1), (m2, o2) = finalize(p1, cfg), compute(shuffled, cfg)
        assert_metrics_close(m2, m1, p1)
        assert_same_offenders(o2, o1)
        for o in o2:
            assert ids[perm[o.index]] == o.request_id


class TestMerge:
    @FAST
    @given(st.data())
    def test_two_ranks_equal_one(self, data):
        """compute_partial on two halves, merge, finalize: the single-rank metrics and offenders."""
        case = data.draw(cases(nonfinite=False))
        batch, n = case.packed(), len(case.lens)
        counted = batch.mask if batch.mask is not None else np.ones(batch.num_tokens, bool)
        upto = np.concatenate([[0], np.cumsum(counted)])[batch.cu_seqlens]  # (N+1,) counted tokens before
        ok = [k for k in range(1, n) if 0 < upto[k] < upto[-1]]  # each rank needs a token (InputError else)
        if not ok:
            return
        k = data.draw(st.sampled_from(ok))
        cfg = StatsConfig(top_k=data.draw(st.integers(1, n + 2)))
        parts = [compute_partial(batch.select(np.arange(k)), cfg), compute_partial(batch.select(np.arange(k, n)), cfg)]
        merged, whole = merge(parts), compute_partial(batch, cfg)
        (m1, o1), (m2, o2) = finalize(whole, cfg), finalize(merged, cfg)
        assert_metrics_close(m2, m1, whole, float32=batch.logp_rollout.dtype == np.float32)
        assert o2 == o1
        for key in whole.hists:
            np.testing.assert_array_equal(merged.hists[key], whole.hists[key])


class TestConstructors:
    @FAST
    @given(cases(edge_tokens_in=True), st.sampled_from(["left", "right"]), st.integers(0, 3), st.integers(0, 2**32 - 1))
    def test_ragged_padded_packed_agree(self, case, side, extra, seed):
        """from_ragged, from_padded (either side, garbage in the padding) and from_packed give one batch."""
        n, width = len(case.lens), max(case.lens) + extra
        rng = np.random.default_rng(seed)
        garbage = {"lr": rng.choice([np.nan, 5.0, -np.inf, -1e9, 0.0], (n, width)),
                   "tokens": rng.integers(-5, 10**6, (n, width))}
        padded = {name: garbage["tokens" if name.startswith("tok") else "lr"].astype(getattr(case, name).dtype)
                  for name in ("lr", "lt", "tokens", "tokens_train")}
        pmask = np.zeros((n, width), bool)
        mask = case.mask if case.mask is not None else np.ones(sum(case.lens), bool)
        cu = case.cu
        for i, ln in enumerate(case.lens):
            cols = slice(width - ln, width) if side == "left" else slice(0, ln)
            for name in padded:
                padded[name][i, cols] = getattr(case, name)[cu[i] : cu[i + 1]]
            pmask[i, cols] = mask[cu[i] : cu[i + 1]]
        batches = [
            case.packed(),
            StepBatch.from_ragged(case.ragged("lr"), case.ragged("lt"), case.ids, case.ragged("tokens"),
                                  mask=case.ragged("mask"), tokens_train=case.ragged("tokens_train")),
            StepBatch.from_padded(padded["lr"], padded["lt"], pmask, case.ids, tokens=padded["tokens"],
                                  tokens_train=padded["tokens_train"]),
        ]
        ref = batches[0]
        for b in batches[1:]:
            np.testing.assert_array_equal(b.cu_seqlens, ref.cu_seqlens)
            for name in ("logp_rollout", "logp_train", "tokens", "tokens_train"):
                np.testing.assert_array_equal(getattr(b, name), getattr(ref, name), err_msg=name)
                assert getattr(b, name).dtype == getattr(ref, name).dtype
            got = b.mask if b.mask is not None else np.ones(b.num_tokens, bool)
            np.testing.assert_array_equal(got, mask)
        (m0, o0), *rest = (compute(b) for b in batches)
        for m, o in rest:
            assert m == m0 and o == o0
