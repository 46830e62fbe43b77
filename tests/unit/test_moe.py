"""Routing agreement math (`rlcheck.core.moe`) on hand-made expert arrays."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.moe import (
    Routing,
    first_diff_layer,
    routing_metrics,
    routing_stats,
    same_experts,
    sequence_routing,
)
from rlcheck.errors import InputError

# 4 tokens, 2 MoE layers, top-2; token 0 alike (order swapped), 1 differs at layer 1, 2 at layer 0,
# 3 at both layers
ROLLOUT = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]], [[5, 6], [7, 0]]])
TRAIN = np.array([[[1, 0], [3, 2]], [[5, 4], [6, 1]], [[0, 3], [1, 3]], [[5, 7], [7, 1]]])
ABS_DIFF = np.array([0.0, 0.3, 0.1, 0.6])


class TestSameExperts:
    def test_compares_sets_not_order(self):
        """A top-k row in another order is the same routing; one other expert is not."""
        agree = same_experts(ROLLOUT, TRAIN)
        np.testing.assert_array_equal(agree, [[True, True], [True, False], [False, True], [False, False]])

    def test_first_diff_layer(self):
        """The first layer that differs, and L for a token routed alike everywhere."""
        np.testing.assert_array_equal(first_diff_layer(same_experts(ROLLOUT, TRAIN)), [2, 1, 0, 0])


class TestRoutingStats:
    def test_hand_computed(self):
        """Agreement, per-layer agreement, first-difference counts and the |d| split, by hand."""
        s = routing_stats(Routing(ROLLOUT, TRAIN), ABS_DIFF)
        assert s.num_tokens == 4 and s.agree_frac == 0.25
        assert s.layer_agree_frac == (0.5, 0.5)
        assert s.first_diff_counts == (2, 1)
        assert s.abs_diff_share == pytest.approx(1.0)  # the alike token has d = 0
        assert np.isnan(s.abs_diff_lift)  # mean |d| of the alike tokens is 0

    def test_mask_and_nonfinite_tokens_are_left_out(self):
        """Masked and non-finite tokens do not count; the lift compares the two groups' mean |d|."""
        d = np.array([0.1, 0.3, np.nan, 0.6])
        s = routing_stats(Routing(ROLLOUT, TRAIN), d, mask=np.array([True, True, True, False]))
        assert s.num_tokens == 2 and s.agree_frac == 0.5
        assert s.abs_diff_share == pytest.approx(0.75) and s.abs_diff_lift == pytest.approx(3.0)

    def test_metrics_keys(self):
        """`routing_metrics` names every layer and leaves an undefined lift out."""
        m = routing_metrics(Routing(ROLLOUT, TRAIN), ABS_DIFF)
        assert m[K.MOE_ROUTE_AGREE_FRAC] == 0.25 and m[K.moe_layer_agree(1)] == 0.5
        assert m[K.moe_first_diff(0)] == 2.0 and K.MOE_ABS_DIFF_LIFT not in m
        assert routing_metrics(Routing(ROLLOUT, TRAIN), ABS_DIFF, mask=np.zeros(4, bool)) == {K.MOE_TOKEN_COUNT: 0.0}


class TestRouting:
    def test_shapes_must_match(self):
        """Different shapes on the two sides are an InputError naming the layout."""
        with pytest.raises(InputError, match="tokens, moe_layers, top_k"):
            Routing(ROLLOUT, TRAIN[:, :1])

    def test_take_concat_and_from_sequences(self):
        """Rows are selected, joined and packed in order."""
        r = Routing(ROLLOUT, TRAIN)
        assert r.take(np.array([3, 0])).experts_train[0, 1, 1] == 1
        assert Routing.concat([r, r]).num_tokens == 8
        packed = Routing.from_sequences([ROLLOUT[:1], ROLLOUT[1:]], [TRAIN[:1], TRAIN[1:]])
        np.testing.assert_array_equal(packed.experts_rollout, ROLLOUT)
        with pytest.raises(InputError, match="3 rows for 4 tokens"):
            r.take(np.arange(3)).check_tokens(4)


class TestSequenceRouting:
    def test_per_sequence_agreement_and_first_layer(self):
        """Sequences [0, 1], [], [2, 3]: agreement and first differing layer per sequence; a masked token
        counts for neither, an empty or wholly masked sequence has NaN and None."""
        routing, cu = Routing(ROLLOUT, TRAIN), np.array([0, 2, 2, 4])
        frac, first = sequence_routing(routing, cu)
        np.testing.assert_array_equal(frac, [0.5, np.nan, 0.0])
        assert first == [1, None, 0]
        frac, first = sequence_routing(routing, cu, mask=np.array([True, False, False, False]))
        np.testing.assert_array_equal(frac, [1.0, np.nan, np.nan])
        assert first == [None, None, None]


class TestMonitorRouting:
    def test_batch_with_routing_logs_moe_metrics(self, tmp_path):
        """A StepBatch carrying routing gets the rlcheck/moe/* metrics in its step report; its
        selected sequences keep their tokens' routing; one without routing gets none."""
        from rlcheck.core.batch import StepBatch
        from rlcheck.core.monitor import Monitor, MonitorConfig

        lr = np.log(np.array([0.5, 0.4, 0.3, 0.2]))
        batch = StepBatch.from_packed(lr, lr + ABS_DIFF, [0, 1, 4], ["a", "b"], routing=Routing(ROLLOUT, TRAIN))
        assert batch.select([1]).routing.num_tokens == 3
        other = StepBatch.from_packed(lr, lr.copy(), [0, 1, 4], ["c", "d"], routing=Routing(TRAIN, TRAIN))
        ragged = StepBatch.from_ragged([lr[:1], lr[1:]], [lr[:1].copy(), lr[1:].copy()], ["a", "b"], routing=Routing(ROLLOUT, TRAIN))
        assert ragged.routing.num_tokens == 4  # the loop's path (engines.vllm.to_step_batch)
        joined = StepBatch.concat([batch, other])
        np.testing.assert_array_equal(joined.routing.experts_rollout[4:], TRAIN)
        with pytest.raises(InputError, match="routing has 3 rows for 4 tokens"):
            StepBatch.from_packed(lr, lr.copy(), [0, 1, 4], ["a", "b"], routing=Routing(ROLLOUT[:3], TRAIN[:3]))
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=()))
        metrics = mon.observe(0, batch).metrics
        assert metrics[K.MOE_ROUTE_AGREE_FRAC] == 0.25 and metrics[K.moe_first_diff(0)] == 2.0
        plain = mon.observe(1, StepBatch.from_packed(lr, lr.copy(), [0, 1, 4], ["a", "b"])).metrics
        assert K.MOE_ROUTE_AGREE_FRAC not in plain


class TestRoutingKeepsTheEvidence:
    def test_mask_not_changed_in_place(self):
        """`routing_stats` leaves the caller's mask as it was (it used to `&=` the finite tokens into it)."""
        mask = np.ones(4, dtype=bool)
        routing_stats(Routing(ROLLOUT, TRAIN), np.array([0.1, np.nan, 0.2, 0.3]), mask)
        assert mask.all()

    def test_nonfinite_token_stays_in_the_halt_dump(self, tmp_path):
        """A NaN logprob in a batch with routing and a mask halts; the dump still holds that token
        masked in (the routing metrics used to mask it out of the batch before the dump was written)."""
        from rlcheck.core.batch import StepBatch
        from rlcheck.core.monitor import Monitor, MonitorConfig
        from rlcheck.core.run.dump import read_dump
        from rlcheck.errors import MismatchHalt

        lr = np.log(np.array([0.5, 0.4, 0.3, 0.2]))
        lt = lr + ABS_DIFF
        lt[2] = np.nan
        batch = StepBatch.from_packed(lr, lt, [0, 1, 4], ["a", "b"], mask=np.ones(4, dtype=bool),
                                      routing=Routing(ROLLOUT, TRAIN))
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=())) as mon, pytest.raises(MismatchHalt) as exc:
            mon.observe(0, batch)
        assert batch.mask.all()
        rows, _ = read_dump(exc.value.dump_dir)
        (b,) = [r for r in rows if r["request_id"] == "b"]
        assert list(b["mask"]) == [True, True, True] and np.isnan(b["logp_train"][1])

    def test_quarantined_sequences_leave_the_routing_metrics(self, tmp_path):
        """The routing metrics, alarm and diagnose rule see the kept tokens: a quarantined corrupt
        sequence, routed differently on every token, does not count (RoutingStats: "over the kept tokens")."""
        from rlcheck.core.batch import StepBatch
        from rlcheck.core.monitor import Monitor, MonitorConfig
        from rlcheck.core.quarantine import QuarantineConfig

        rng = np.random.default_rng(0)
        lens = [16] * 20
        lr = [-rng.exponential(1.0, n) for n in lens]
        lt = [x + rng.normal(0, 1e-3, x.shape) for x in lr]
        lt[3] = lr[3] - 12.0  # corrupt: quarantined as catastrophic (1 of 20, within max_frac)
        train = [np.tile([[0, 1], [2, 3]], (n, 1, 1)) for n in lens]
        engine = [t.copy() for t in train]
        engine[3][:, 1] = [4, 5]  # every token of the corrupt sequence routed elsewhere at layer 1
        batch = StepBatch.from_ragged(lr, lt, [f"r{i}" for i in range(20)],
                                      routing=Routing.from_sequences(engine, train))
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=(), quarantine=QuarantineConfig())
        with Monitor(cfg) as mon:
            report = mon.observe(0, batch)
        assert [q.index for q in report.quarantined] == [3]
        assert report.metrics[K.MOE_TOKEN_COUNT] == 19 * 16 and report.metrics[K.MOE_ROUTE_AGREE_FRAC] == 1.0
        assert not [a for a in report.alarms if a.metric == K.MOE_ABS_DIFF_SHARE]


class TestRoutingAlarms:
    def test_warns_when_the_rerouted_tokens_carry_the_mismatch(self):
        """A warning when the tokens routed differently carry at least half of sum |d| and twice their
        share of the tokens; bf16-like noise (1% rerouted carrying 10%), full agreement, or no routing
        metrics: none."""
        from rlcheck.core.moe import routing_alarms

        def metrics(agree, share):
            return {K.MOE_ROUTE_AGREE_FRAC: agree, K.MOE_ABS_DIFF_SHARE: share}

        (alarm,) = routing_alarms(3, metrics(0.9, 0.8))
        assert (alarm.kind, alarm.metric, alarm.severity, alarm.step) == ("threshold", K.MOE_ABS_DIFF_SHARE, "warn", 3)
        assert "10.0% of the tokens" in alarm.message and "80%" in alarm.message
        assert routing_alarms(3, metrics(0.99, 0.10)) == []
        assert routing_alarms(3, metrics(0.6, 0.7)) == []  # 40% rerouted carrying 70%: not concentrated
        assert routing_alarms(3, metrics(1.0, 0.0)) == [] and routing_alarms(3, {}) == []

    def test_the_monitor_raises_it(self, tmp_path):
        """Through `Monitor.observe`: the step whose rerouted token carries the mismatch has the warning."""
        from rlcheck.core.batch import StepBatch
        from rlcheck.core.monitor import Monitor, MonitorConfig

        lr = np.log(np.array([0.5, 0.4, 0.3, 0.2]))
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=()))
        engine = ROLLOUT.copy()
        engine[3, 1] = [4, 0]  # the last token alone rerouted at layer 1, and it carries 0.6 of 1.0 nats
        routing = Routing(engine, ROLLOUT)
        report = mon.observe(0, StepBatch.from_packed(lr, lr + ABS_DIFF, [0, 1, 4], ["a", "b"], routing=routing))
        assert [a.metric for a in report.alarms if a.metric.startswith("rlcheck/moe/")] == [K.MOE_ABS_DIFF_SHARE]
        assert report.metrics[K.ALARM_COUNT] == len(report.alarms)


def routed_batch(step: int, flip: float, seed: int = 0):
    """A synthetic step with 2-layer top-2 routing; from step 32, a fraction `flip` of the tokens is
    routed to another expert at layer 1 in the engine and their |d| grows by ~1 nat."""
    import dataclasses

    from rlcheck.synthetic import SyntheticConfig, synthetic_batch

    batch = synthetic_batch(SyntheticConfig(num_sequences=64, mean_length=64), step)
    rng = np.random.default_rng([seed, step])
    m = batch.num_tokens
    train = np.stack([rng.permutation(8)[:4].reshape(2, 2) for _ in range(m)])  # (M, 2, 2)
    rollout = train.copy()
    moved = rng.random(m) < (flip if step >= 32 else 0.0)
    rollout[moved, 1, 1] = train[moved, 0, 0]  # a layer-0 expert: never one of layer 1's (a permutation)
    lt = batch.logp_train.copy()
    lt[moved] = np.minimum(lt[moved] - rng.choice([-1.0, 1.0], moved.sum()) * 1.0, 0.0)
    return dataclasses.replace(batch, logp_train=lt, routing=Routing(rollout, train))


class TestDiagnoseMoeRouting:
    def run(self, tmp_path, flip: float):
        from rlcheck.core.monitor import Monitor, MonitorConfig
        from rlcheck.errors import MismatchHalt
        from rlcheck.forensics.diagnose import diagnose

        with Monitor(MonitorConfig(run_dir=tmp_path / f"run{flip}", sinks=("jsonl",))) as mon:
            for step in range(45):
                try:
                    mon.observe(step, routed_batch(step, flip))
                except MismatchHalt:
                    break
        return diagnose(tmp_path / f"run{flip}")

    def test_names_moe_routing_when_rerouted_tokens_carry_the_mismatch(self, tmp_path):
        """Rerouted tokens carrying the mismatch from step 32: the verdict is moe_routing, naming layer 1."""
        result = self.run(tmp_path, 0.05)
        assert result.verdict.cause == "moe_routing", result.to_dict()
        assert "MoE layer 1" in " ".join(result.verdict.evidence) and min(result.verdict.affected_steps) >= 32

    def test_healthy_routing_run_is_healthy(self, tmp_path):
        """The same stream with routing alike everywhere raises nothing: healthy."""
        assert self.run(tmp_path, 0.0).verdict.cause == "healthy"
