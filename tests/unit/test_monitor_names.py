"""Issue 42 item 2: threshold rules and hard limits see every metric the Monitor logs (the correction's,
the quarantine's, the MoE routing's, the weights'), and a rule or limit on a name no metric has is
refused when the MonitorConfig is built, naming the closest known one (`rlcheck.core.metrics`)."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck import HaltConfig, MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.detect import DetectorsConfig, DriftConfig, ThresholdConfig, ThresholdRule
from rlcheck.core.moe import Routing
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.errors import ConfigError

ALL_RS = ",".join(K.CORR_RS_OPTIONS)


def batch(seed=0, n=8, length=30, corrupt=None, routing=False, version=None):
    """Healthy bf16-like noise, sequence `corrupt` catastrophic; with `routing`, a 2-layer top-2 MoE
    routing that differs on a few tokens."""
    rng = np.random.default_rng(seed)
    lr = [-rng.exponential(1.0, length) for _ in range(n)]
    lt = [np.minimum(x + rng.normal(0, 0.02, length), 0.0) for x in lr]
    if corrupt is not None:
        lr[corrupt] = np.full(length, -25.0)
    kw = {}
    if routing:
        experts = rng.integers(0, 8, (n * length, 2, 2))
        moved = experts.copy()
        moved[::7, 1, 0] = (moved[::7, 1, 0] + 1) % 8
        kw["routing"] = Routing(experts, moved)
    if version is not None:
        kw["weight_version"] = version
    return StepBatch.from_ragged(logp_rollout=lr, logp_train=lt, request_ids=[f"r{i}" for i in range(n)], **kw)


def rule(metric, limit, severity="warn"):
    return DetectorsConfig(threshold=ThresholdConfig(rules=(ThresholdRule(metric, limit, severity),), rearm=None))


class TestRulesSeeEveryMetric:
    """A rule or a hard limit on a metric the Monitor adds after the statistics fires."""

    CASES = {
        "corr": (K.CORR_PREFIX + "rollout_is_mean", dict(correction=CorrectionConfig(rollout_is="token")), {}),
        "quarantine": (K.QUARANTINE_FRAC, dict(quarantine=QuarantineConfig(max_frac=0.5)), dict(corrupt=3)),
        "moe": (K.MOE_TOKEN_COUNT, {}, dict(routing=True)),
        "weights": (K.WEIGHTS_MAX_LAG, dict(max_weight_lag=5), dict(version=3)),
    }

    @pytest.mark.parametrize("case", CASES)
    def test_threshold_rule_fires(self, tmp_path, case):
        """A threshold rule at -1 on the metric raises its alarm (never did before for corr, quarantine,
        moe and weights: the detectors ran before those metrics were added)."""
        metric, cfg, kw = self.CASES[case]
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=(), detectors=rule(metric, -1.0), **cfg)) as mon:
            report = mon.observe(0, batch(**kw), trainer_version=4 if "version" in kw else None)
        assert metric in report.metrics
        assert [a.metric for a in report.alarms if a.kind == "threshold"] == [metric]

    @pytest.mark.parametrize("case", CASES)
    def test_hard_limit_halts(self, tmp_path, case):
        """A hard limit at -1 on the metric halts the step, naming it."""
        metric, cfg, kw = self.CASES[case]
        halt = HaltConfig(hard_limits={metric: -1.0})
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=(), halt=halt, **cfg))
        with pytest.raises(MismatchHalt, match=metric.replace("/", ".")):
            mon.observe(0, batch(**kw), trainer_version=4 if "version" in kw else None)

    def test_every_logged_key_is_known(self, tmp_path):
        """Every rlcheck/ key of a step with every correction option, quarantine, MoE routing and weight
        versions is a name a rule may watch (the known names cannot fall behind what is logged)."""
        cfg = CorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
                               rollout_rs=ALL_RS, rollout_rs_threshold=10.0)
        mcfg = MonitorConfig(run_dir=tmp_path / "run", sinks=(), correction=cfg, max_weight_lag=5,
                             quarantine=QuarantineConfig(max_frac=0.5))
        with Monitor(mcfg) as mon:
            report = mon.observe(0, batch(corrupt=3, routing=True, version=3), trainer_version=4)
        keys = [k for k in report.metrics if k.startswith(K.PREFIX)]
        assert any(k.startswith(K.CORR_PREFIX + "rollout_rs_seq_max_k3") for k in keys) and K.MOE_TOKEN_COUNT in keys
        assert [k for k in keys if not K.is_known(k)] == []


class TestUnknownNamesRefused:
    """A name no metric has is a ConfigError at MonitorConfig, with the closest known name."""

    @pytest.mark.parametrize("kw, where, near", [
        (dict(halt=HaltConfig(hard_limits={"rlcheck/corr/rollout_is_maen": 1.0})), "hard_limits",
         "rlcheck/corr/rollout_is_mean"),
        (dict(detectors=rule("rlcheck/token/abs_dif_mean", 1.0)), "threshold rule 0", K.ABS_DIFF_MEAN),
        (dict(detectors=DetectorsConfig(drift=DriftConfig(metrics=("rlcheck/token/abs_diff_clipped_men",)))),
         "drift.metrics", K.ABS_DIFF_CLIPPED_MEAN),
        (dict(halt=HaltConfig(hard_limits={"rlcheck/moe/layer2_agree_fraction": 0.5})), "hard_limits",
         "rlcheck/moe/layer0_agree_frac"),
    ])
    def test_typo_names_the_closest(self, tmp_path, kw, where, near):
        """The error says where the name is and which known name is nearest."""
        with pytest.raises(ConfigError, match=where) as err:
            MonitorConfig(run_dir=tmp_path / "run", **kw)
        assert repr(near) in str(err.value)

    def test_own_scalar_is_refused_with_why(self, tmp_path):
        """A threshold rule on one of the caller's own scalars (observe's `extra`) is refused: the detectors
        never see them; a hard limit may watch them."""
        with pytest.raises(ConfigError, match="hard limits only"):
            MonitorConfig(run_dir=tmp_path / "run", detectors=rule("loop/reward_mean", 1.0))
        MonitorConfig(run_dir=tmp_path / "run", halt=HaltConfig(hard_limits={"loop/reward_mean": 1.0}))

    @pytest.mark.parametrize("name", [K.frac_abs_diff_above(0.25), K.moe_layer_agree(11), K.moe_first_diff(3),
                                      K.quarantine_reason("tail"), K.CORR_PREFIX + "rollout_rs_seq_mean_k1_seq_fraction_low",
                                      K.PROBE_LEVEL, K.DIST_KL_MEAN, K.WEIGHTS_STALE_COUNT])
    def test_family_and_fixed_names_accepted(self, tmp_path, name):
        """Keys made by a family's function and every constant of the metrics module are accepted."""
        MonitorConfig(run_dir=tmp_path / "run", halt=HaltConfig(hard_limits={name: 1.0}), detectors=rule(name, 1.0))

    def test_defaults_are_known(self, tmp_path):
        """The default rules, limits and detector metrics are all known names (a default config builds)."""
        MonitorConfig(run_dir=tmp_path / "run")
