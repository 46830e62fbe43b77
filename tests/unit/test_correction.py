"""rlcheck.core.correction against verl's own rollout correction (`verl.trainer.ppo.rollout_corr_helper`,
0.9.1) on the same numbers: verl gets a padded [B, T] float32 batch (ragged rows, masked tool spans,
fully masked rows, garbage on padding), rlcheck the same tokens packed two ways: the valid tokens
only, and whole rows with the mask carried. Weights, masks and every IS/RS metric must agree.

Needs verl (imported without its heavy deps; see tests/integration/test_verl.py); the config tests
run without it.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core import correction as C
from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.errors import ConfigError

RTOL, ATOL = 1e-5, 1e-6  # verl reduces in float32, rlcheck in float64
ROWS, COLS = 16, 12
EMPTY_ROWS = (3, 11)

IS_CASES = {
    "token_tis": dict(rollout_is="token", rollout_is_threshold=2.0),
    "sequence_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_2.0"),
    "sequence_icepop": dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0"),
    "token_tis_normalized": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    "sequence_tis_normalized": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    "token_icepop_normalized": dict(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
}
RS_CASES = {
    "geometric_mean": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"),
    "seq_mean_k3": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "token_k3": dict(rollout_rs="token_k3", rollout_rs_threshold=0.01),
    "seq_max_k3": dict(rollout_rs="seq_max_k3", rollout_rs_threshold=0.05),
    "seq_sum_k2": dict(rollout_rs="seq_sum_k2", rollout_rs_threshold=0.1),
    "chain": dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.8_1.25,0.01"),
}
BOTH_CASES = {
    "token_tis_seq_mean_k3": dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "sequence_icepop_chain": dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
                                  rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.8_1.25,0.01"),
}


@pytest.fixture(scope="module")
def verl_corr():
    return pytest.importorskip("verl.trainer.ppo.rollout_corr_helper",
                               reason="pip install --no-deps verl==0.9.1 (see tests/integration/test_verl.py)")


def padded(seed: int = 0, corrupt: int | None = None) -> dict[str, np.ndarray]:
    """A verl-like step: rollout (B, T) and old (B, T) float32 logprobs, response_mask (B, T) int64.

    Rows are right-padded to ragged lengths, rows EMPTY_ROWS fully masked, every third row has a
    masked tool span; the mismatch scale varies by row (0.02 / 0.1 / 0.3) so every threshold below
    keeps some sequences and rejects others, and a few tokens lie past both IS bounds. Padding holds the actor's own (nonzero) scores, as in verl.
    `corrupt`: that row's rollout logprobs set to -25 on its response tokens."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, COLS + 1, ROWS)
    mask = (np.arange(COLS) < lens[:, None]).astype(np.int64)  # (B, T)
    mask[list(EMPTY_ROWS)] = 0
    mask[::3, 1:3] = 0
    scale = np.array([0.02, 0.1, 0.3])[np.arange(ROWS) % 3][:, None]
    rollout = np.where(mask > 0, -rng.exponential(1.0, (ROWS, COLS)), 0.0).astype(np.float32)
    noise = rng.normal(0.0, 1.0, (ROWS, COLS)) * scale
    rollout[[1, 4, 7, 10], 0] = -2.0
    noise[[1, 4, 7, 10], 0] = [1.2, -1.2, 0.9, -0.9]  # past both TIS bounds, short of catastrophic
    old = np.minimum(rollout + noise, 0.0).astype(np.float32)
    old = np.where(mask > 0, old, -rng.exponential(1.0, (ROWS, COLS))).astype(np.float32)
    if corrupt is not None:
        rollout[corrupt] = np.where(mask[corrupt] > 0, -25.0, rollout[corrupt])
    return {"rollout": rollout, "old": old, "mask": mask}


def packed(p: dict[str, np.ndarray], layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d (M,), mask (M,), cu (B+1,), take (B, T) bool): the log ratio verl sees (float32 old -
    rollout), packed from the valid tokens only ("valid") or from whole rows ("rows"); `take`
    picks the padded positions the packed tokens came from."""
    d = p["old"] - p["rollout"]  # (B, T) float32, as verl's log_ratio
    m = p["mask"].astype(bool)
    take = m if layout == "valid" else np.ones_like(m)
    cu = np.concatenate([[0], np.cumsum(take.sum(axis=1))]).astype(np.int64)
    return d[take], m[take], cu, take


def verl_inputs(p: dict[str, np.ndarray]):
    import torch

    return torch.from_numpy(p["old"]), torch.from_numpy(p["rollout"]), torch.from_numpy(p["mask"])


def nonempty(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`p` without its fully masked rows: verl's metrics of these equal rlcheck's of the whole batch, whose
    per-sequence metrics count only the sequences with a valid token (verl counts an empty row as a
    sequence of weight 0; issue 42 item 3)."""
    rows = p["mask"].sum(axis=1) > 0
    return {k: v[rows] for k, v in p.items()}


def assert_metrics_equal(ours: dict[str, float], theirs: dict[str, float]) -> None:
    """Same keys (verl's IS and RS metrics), same values to float32 tolerance."""
    theirs = {k.removeprefix("rollout_corr/"): v for k, v in theirs.items()}
    theirs = {k: v for k, v in theirs.items() if k.startswith(("rollout_is", "rollout_rs"))}
    assert set(ours) == set(theirs), (set(ours) ^ set(theirs))
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key


def rs_keys(options: str) -> set[str]:
    """The RS metric keys the brief promises, per option and combined."""
    keys = {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}
    for opt in options.split(","):
        p = f"rollout_rs_{opt}"
        keys |= {f"{p}_{k}" for k in ("masked_fraction", "seq_masked_fraction", "mean", "max", "min", "fraction_high",
                                      "fraction_low", "std", "seq_mean", "seq_std", "seq_max", "seq_min",
                                      "seq_max_deviation", "seq_fraction_high")}
    return keys


LAYOUTS = ("valid", "rows")


def both_sides(layout: str):
    """(log_ratio (B, T), response_mask (B, T)) for verl; (d (M,) zeroed off the mask, mask (M,)
    float, cu, take) for rlcheck's `is_weights` / `rs_mask`, from `padded()`; and verl's
    (log_ratio, response_mask) of its non-empty rows (`nonempty`), for the metrics."""
    p = padded()
    old, rollout, mask = verl_inputs(p)
    d, m, cu, take = packed(p, layout)
    old_ne, rollout_ne, mask_ne = verl_inputs(nonempty(p))
    return (old - rollout, mask, np.where(m, d, 0.0).astype(np.float64), m.astype(np.float64), cu, take,
            (old_ne - rollout_ne, mask_ne))


class TestISWeights:
    """`is_weights` against verl's `compute_rollout_correction_weights`."""

    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("case", IS_CASES)
    def test_weights_and_metrics_equal_verl(self, verl_corr, case, layout):
        """Weights (0 on padding) and every metric equal verl's on the same tokens."""
        kw = IS_CASES[case]
        args = kw["rollout_is"], kw["rollout_is_threshold"], kw.get("rollout_is_batch_normalize", False)
        log_ratio, mask, d, m, cu, take, kept = both_sides(layout)
        want, _ = verl_corr.compute_rollout_correction_weights(log_ratio, mask, *args)
        _, want_metrics = verl_corr.compute_rollout_correction_weights(*kept, *args)
        got, got_metrics = C.is_weights(d, m, cu, *args)
        np.testing.assert_allclose(got, want.numpy()[take], rtol=RTOL, atol=ATOL)
        assert_metrics_equal(got_metrics, want_metrics)

    def test_cases_exercise_the_bounds(self, verl_corr):
        """The data is such that the cap, the IcePop cut and both tails are all hit (else the
        comparisons above prove little)."""
        p = padded()
        old, rollout, mask = verl_inputs(p)
        for level in ("token", "sequence"):
            _, metrics = verl_corr.compute_rollout_correction_weights(old - rollout, mask, level, "0.5_2.0")
            assert metrics["rollout_is_ratio_fraction_high"] > 0 and metrics["rollout_is_ratio_fraction_low"] > 0
            assert 0 < metrics["rollout_is_oob_ratio"] < 0.5


class TestRSMask:
    """`rs_mask` against verl's `compute_rollout_rejection_mask`."""

    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("case", RS_CASES)
    def test_mask_and_metrics_equal_verl(self, verl_corr, case, layout):
        """The kept tokens and every metric equal verl's; some sequences are kept and some rejected."""
        kw = RS_CASES[case]
        log_ratio, mask, d, m, cu, take, kept = both_sides(layout)
        want, _ = verl_corr.compute_rollout_rejection_mask(log_ratio, mask, **kw)
        _, want_metrics = verl_corr.compute_rollout_rejection_mask(*kept, **kw)
        got, got_metrics = C.rs_mask(d, m, cu, kw["rollout_rs"], kw["rollout_rs_threshold"])
        np.testing.assert_array_equal(got, want.numpy()[take])
        assert_metrics_equal(got_metrics, want_metrics)
        assert rs_keys(kw["rollout_rs"]) <= set(got_metrics)
        assert 0 < got_metrics["rollout_rs_seq_masked_fraction"] < 1

    def test_k1_bounds_are_on_the_rollout_over_train_ratio(self, verl_corr):
        """k1 = -d: "0.9_1.1" keeps exp(-mean d) in [0.9, 1.1], so exp(mean d) = 1.105 passes and
        0.905 does not (the two readings part there), as in verl."""
        import torch

        d = np.log(np.array([[1.105] * 4, [0.905] * 4]))  # (2, 4)
        want, _ = verl_corr.compute_rollout_rejection_mask(torch.from_numpy(d), torch.ones(2, 4), "seq_mean_k1", "0.9_1.1")
        got, _ = C.rs_mask(d.reshape(-1), np.ones(8), np.array([0, 4, 8]), "seq_mean_k1", "0.9_1.1")
        assert want[:, 0].tolist() == [1.0, 0.0] and got.tolist() == want.reshape(-1).tolist()


class TestCompute:
    """`compute` against verl's `compute_rollout_correction_and_rejection_mask`."""

    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("case", {**IS_CASES, **RS_CASES, **BOTH_CASES})
    def test_equal_verl(self, verl_corr, case, layout):
        """Weights are verl's times its rejection mask, the mask is verl's, the metrics verl's
        (but its off-policy ones, which rlcheck logs under its own names)."""
        kw = {**IS_CASES, **RS_CASES, **BOTH_CASES}[case]
        p = padded()
        proto, want_mask, _ = verl_corr.compute_rollout_correction_and_rejection_mask(*verl_inputs(p), **kw)
        _, _, want_metrics = verl_corr.compute_rollout_correction_and_rejection_mask(*verl_inputs(nonempty(p)), **kw)
        d, m, cu, take = packed(p, layout)
        got = C.compute(d, m, cu, C.CorrectionConfig(**kw))
        want_w = want_mask.numpy().astype(np.float32)
        if proto is not None:
            want_w = want_w * proto.batch["rollout_is_weights"].numpy()
        np.testing.assert_array_equal(got.mask, want_mask.numpy()[take].astype(bool))
        np.testing.assert_allclose(got.weights, want_w[take], rtol=RTOL, atol=ATOL)
        assert got.weights.dtype == np.float32 and got.mask.dtype == bool
        assert_metrics_equal(got.metrics, want_metrics)

    def test_off_is_all_ones_on_the_mask(self):
        """With nothing enabled the weights are the response mask itself, and there are no metrics."""
        d, m, cu, _ = packed(padded(), "rows")
        got = C.compute(d, m, cu, C.CorrectionConfig())
        np.testing.assert_array_equal(got.weights, m.astype(np.float32))
        assert got.metrics == {} and not C.CorrectionConfig().enabled

    def test_prefixed(self):
        """`prefixed` puts every metric under rlcheck/corr/."""
        d, m, cu, _ = packed(padded(), "valid")
        got = C.compute(d, m, cu, C.CorrectionConfig(rollout_is="token")).prefixed()
        assert "rlcheck/corr/rollout_is_eff_sample_size" in got and all(k.startswith(C.PREFIX) for k in got)


class TestStepReport:
    """The Monitor's route: a quarantined sequence is outside every weight `StepReport` hands out."""

    BAD = 14

    def _report(self, tmp_path):
        p = padded(corrupt=self.BAD)
        batch = StepBatch.from_padded(p["rollout"], p["old"], p["mask"], [f"r{i}" for i in range(ROWS)])
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=(), quarantine=QuarantineConfig(max_frac=0.2))
        with Monitor(cfg) as mon:
            report = mon.observe(0, batch)
        assert [q.index for q in report.quarantined] == [self.BAD]
        masked = dict(p, mask=np.where(np.arange(ROWS)[:, None] == self.BAD, 0, p["mask"]))
        return report, batch, p, masked

    def test_token_weights_zero_on_quarantined_verl_elsewhere(self, verl_corr, tmp_path):
        """token_weights() is 0 on the quarantined sequence's tokens and verl's token TIS weights
        (its response_mask with that row zeroed) everywhere else."""
        report, batch, p, masked = self._report(tmp_path)
        old, rollout, mask = verl_inputs(masked)
        want, _ = verl_corr.compute_rollout_correction_weights(old - rollout, mask, "token", 2.0)
        got = report.token_weights()
        cu = batch.cu_seqlens
        assert got.shape == (batch.num_tokens,) and not got[cu[self.BAD]:cu[self.BAD + 1]].any()
        # the packed tokens of batch.mask are the padded batch's response tokens, in row-major order
        np.testing.assert_allclose(got[batch.mask], want.numpy()[p["mask"].astype(bool)], rtol=RTOL, atol=ATOL)

    def test_correction_metrics_equal_verl(self, verl_corr, tmp_path):
        """report.correction(...) gives verl's metrics of the batch without the quarantined row."""
        report, _, _, masked = self._report(tmp_path)
        kw = BOTH_CASES["sequence_icepop_chain"]
        _, _, want = verl_corr.compute_rollout_correction_and_rejection_mask(*verl_inputs(nonempty(masked)), **kw)
        assert_metrics_equal(report.correction(**kw).metrics, want)

    def test_sequence_weights(self, verl_corr, tmp_path):
        """sequence_weights() is verl's sequence TIS weight of each row, 0 for the quarantined one."""
        report, _, _, masked = self._report(tmp_path)
        old, rollout, mask = verl_inputs(masked)
        want, _ = verl_corr.compute_rollout_correction_weights(old - rollout, mask, "sequence", 2.0)
        want = want.numpy().max(axis=1)  # one weight per row, 0 on fully masked rows
        got = report.sequence_weights()
        assert got[self.BAD] == 0
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


class TestComputedOnce:
    """Issue 42 item 13: the step's correction is computed once, for the Monitor's metrics and the loss."""

    def test_monitor_correction_reused_by_the_loss(self, tmp_path, monkeypatch):
        """With MonitorConfig.correction set, observe computes it once and report.correction() (token and
        sequence weights too) with the same settings hands that one out; other settings compute anew."""
        calls = []
        real = C.compute
        monkeypatch.setattr(C, "compute", lambda *a, **k: calls.append(1) or real(*a, **k))
        p = padded()
        batch = StepBatch.from_padded(p["rollout"], p["old"], p["mask"], [f"r{i}" for i in range(ROWS)])
        cfg = C.CorrectionConfig(rollout_is="sequence")
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=(), correction=cfg)) as mon:
            report = mon.observe(0, batch)
        assert len(calls) == 1
        c = report.correction(rollout_is="sequence")
        report.sequence_weights()
        assert len(calls) == 1 and c.metrics == {k.removeprefix(C.PREFIX): v for k, v in report.metrics.items()
                                                 if k.startswith(C.PREFIX)}
        report.token_weights()
        assert len(calls) == 2
        report.release()
        assert report.corrections == {}


class TestConfig:
    """`CorrectionConfig` refuses what verl would refuse, with rlcheck's ConfigError."""

    @pytest.mark.parametrize("kw", [
        dict(rollout_is="tok"),
        dict(rollout_is="token", rollout_is_threshold=0.0),
        dict(rollout_is="token", rollout_is_threshold=-1.0),
        dict(rollout_is="token", rollout_is_threshold="2.0_0.5"),
        dict(rollout_is="token", rollout_is_threshold="0_2.0"),
        dict(rollout_is="token", rollout_is_threshold="a_b"),
        dict(rollout_is="token", rollout_is_threshold=True),
        dict(rollout_is="token", rollout_is_threshold=None),
        dict(rollout_rs="seq_mean_k4", rollout_rs_threshold=0.01),
        dict(rollout_rs="seq_mean_k3"),
        dict(rollout_rs="seq_mean_k3", rollout_rs_threshold="0.5_2.0"),
        dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=-0.01),
        dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="1.1_0.9"),
        dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="1,2,3"),
        dict(rollout_rs="seq_mean_k3", rollout_rs_threshold="x"),
        dict(rollout_rs=",", rollout_rs_threshold=0.01),
    ])
    def test_bad_config_raises(self, kw):
        """Each bad field raises ConfigError naming the field."""
        with pytest.raises(ConfigError, match="rollout_(is|rs)"):
            C.CorrectionConfig(**kw)

    @pytest.mark.parametrize("kw", [
        dict(rollout_is="token", rollout_is_threshold="2.0"),
        dict(rollout_is="sequence", rollout_is_threshold=" 0.5_2.0 "),
        dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.1),
        dict(rollout_rs="token_k1,seq_mean_k3,seq_mean_k3", rollout_rs_threshold="0.8_1.25,0.01"),
    ])
    def test_accepted_as_verl_accepts(self, verl_corr, kw):
        """What verl's parsers take, rlcheck takes, and reads the same bounds from."""
        C.CorrectionConfig(**kw)
        if "rollout_is_threshold" in kw:
            assert C.parse_is_threshold(kw["rollout_is_threshold"]) == verl_corr._parse_rollout_is_threshold(
                kw["rollout_is_threshold"])
        else:
            opts = list(dict.fromkeys(kw["rollout_rs"].split(",")))
            theirs = verl_corr._parse_rollout_rs_thresholds(opts, kw["rollout_rs_threshold"])
            assert C.parse_rs(kw["rollout_rs"], kw["rollout_rs_threshold"]) == {
                o: (t["lower"], t["upper"]) for o, t in theirs.items()}

    def test_sequence_weights_refuse_token_level(self):
        """sequence_weights takes no token-level IS or rejection."""
        d, m, cu, _ = packed(padded(), "valid")
        keep = np.ones(ROWS, dtype=bool)
        with pytest.raises(ConfigError, match="token_weights"):
            C.sequence_weights(d, m, cu, keep, C.CorrectionConfig(rollout_is="token"))
        with pytest.raises(ConfigError, match="sequence-level"):
            C.sequence_weights(d, m, cu, keep, C.CorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold=0.01))


class TestLongEpisodes:
    """Issue 42 item 1: the sequence weight of a long episode, in log space, clamped at both ends."""

    LONG = 32_000

    def _long(self, mean_d: float, num: int = 2):
        d = np.full(num * self.LONG, mean_d)
        return d, np.ones_like(d, dtype=bool), np.arange(num + 1, dtype=np.int64) * self.LONG

    @pytest.mark.parametrize("mean_d", [0.03, -0.03])
    @pytest.mark.parametrize("level", C.LEVELS)
    def test_no_overflow_on_32k_tokens(self, level, mean_d):
        """Two 32k-token sequences at mean d +-0.03 (a summed log ratio of +-960, past exp's 709.8):
        finite weights and metrics at every level, TIS and IcePop (OverflowError before)."""
        d, m, cu = self._long(mean_d)
        for threshold in (2.0, "0.5_2.0"):
            c = C.compute(d, m, cu, C.CorrectionConfig(rollout_is=level, rollout_is_threshold=threshold,
                                                       rollout_rs="seq_sum_k3", rollout_rs_threshold=1e9))
            assert np.isfinite(c.weights).all() and all(np.isfinite(v) for v in c.metrics.values()), c.metrics

    def test_sequence_collapses_geometric_does_not(self):
        """At mean d 0.03 the product of the ratios sits at the clamp (exp(20)), capped to 2, while the
        geometric mean is exp(0.03): what the module docstring tells long-episode users."""
        d, m, cu = self._long(0.03)
        seq = C.compute(d, m, cu, C.CorrectionConfig(rollout_is="sequence"))
        geo = C.compute(d, m, cu, C.CorrectionConfig(rollout_is="geometric"))
        assert seq.metrics["rollout_is_max"] == pytest.approx(np.exp(20.0)) and (seq.weights == 2.0).all()
        assert seq.metrics["rollout_is_ratio_fraction_high"] == 1.0
        np.testing.assert_allclose(geo.weights, np.exp(0.03), rtol=1e-6)
        assert geo.metrics["rollout_is_ratio_fraction_high"] == 0.0

    def test_geometric_is_the_per_token_mean(self):
        """geometric: exp(mean d) of each sequence's valid tokens, the same for all of its tokens."""
        d, m, cu, _ = packed(padded(), "valid")
        c = C.compute(d, m, cu, C.CorrectionConfig(rollout_is="geometric", rollout_is_threshold=1e6))
        for i in range(ROWS):
            sl = slice(cu[i], cu[i + 1])
            if m[sl].any():
                np.testing.assert_allclose(c.weights[sl][m[sl]], np.exp(d[sl][m[sl]].mean()), rtol=1e-6)

    def test_geometric_refuses_token_weights_only_where_token(self):
        """sequence_weights takes geometric (a sequence level) like sequence."""
        d, m, cu, _ = packed(padded(), "valid")
        keep = np.ones(ROWS, dtype=bool)
        got = C.sequence_weights(d, m, cu, keep, C.CorrectionConfig(rollout_is="geometric"))
        assert got.shape == (ROWS,) and (got[list(EMPTY_ROWS)] == 0).all() and (got[got > 0] <= 2.0).all()


class TestKeptSequences:
    """Issue 42 item 3: per-sequence metrics are over the sequences the correction keeps, not over
    quarantined or fully masked ones counted as weight 0."""

    def _report(self, tmp_path, level):
        n, length = 3, 7  # the kept sides bitwise equal on 14 tokens
        lr = [np.full(length, -1.0) for _ in range(n)]
        lt = [x.copy() for x in lr]
        lr[2][:] = -25.0  # the quarantined one
        batch = StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=["a", "b", "c"])
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=(), quarantine=QuarantineConfig(max_frac=0.5),
                            correction=C.CorrectionConfig(rollout_is=level))
        with Monitor(cfg) as mon:
            report = mon.observe(0, batch)
        assert [q.index for q in report.quarantined] == [2]
        return report

    @pytest.mark.parametrize("level", C.LEVELS)
    def test_quarantined_sequence_not_counted(self, tmp_path, level):
        """d = 0 on the kept sequences, 1 of 3 quarantined: seq_min 1, max deviation 0, fraction low 0
        (0, 1.0 and 0.33 before), in the report's correction and in the logged rlcheck/corr/ metrics."""
        report = self._report(tmp_path, level)
        for got in (report.correction(rollout_is=level).metrics,
                    {k.removeprefix(C.PREFIX): v for k, v in report.metrics.items() if k.startswith(C.PREFIX)}):
            assert got["rollout_is_seq_min"] == pytest.approx(1.0) and got["rollout_is_seq_mean"] == pytest.approx(1.0)
            assert got["rollout_is_seq_max_deviation"] == pytest.approx(0.0, abs=1e-8)
            assert got["rollout_is_seq_fraction_low"] == 0.0 and got["rollout_is_seq_fraction_high"] == 0.0
            assert got["rollout_is_ratio_fraction_low"] == 0.0 and got["rollout_is_min"] == 1.0

    def test_rejection_fractions_over_kept_sequences(self):
        """rollout_rs_seq_masked_fraction counts the sequences with a valid token: 1 of 2, not 1 of 4."""
        d = np.array([0.0, 0.0, 0.5, 0.5, 9.0, 9.0, 0.0, 0.0])
        m = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
        cu = np.array([0, 2, 4, 6, 8])
        c = C.compute(d, m, cu, C.CorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01))
        assert c.metrics["rollout_rs_seq_masked_fraction"] == 0.5
        assert c.metrics["rollout_rs_seq_mean_k3_seq_masked_fraction"] == 0.5


class TestTally:
    """The metrics of a batch split in parts and tallied part by part equal those of the whole batch
    (what several ranks reduce; issue 42 item 4)."""

    @pytest.mark.parametrize("case", {**IS_CASES, **RS_CASES, **BOTH_CASES, "geometric": dict(rollout_is="geometric")})
    def test_parts_merge_to_the_whole(self, case):
        """Rows split 5 / 0 / 11 (an empty part included): the merged tally's metrics equal the whole's."""
        cfg = C.CorrectionConfig(**{**IS_CASES, **RS_CASES, **BOTH_CASES, "geometric": dict(rollout_is="geometric")}[case])
        d, m, cu, _ = packed(padded(), "rows")
        whole = C.compute(d, m, cu, cfg)
        parts = []
        for lo, hi in ((0, 5), (5, 5), (5, ROWS)):
            sl = slice(cu[lo], cu[hi])
            parts.append(C.compute(d[sl], m[sl], cu[lo:hi + 1] - cu[lo], cfg).tally)
        merged = C.metrics_of(C.Tally.merge(parts), cfg)
        assert set(merged) == set(whole.metrics)
        for key, value in whole.metrics.items():
            assert merged[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
