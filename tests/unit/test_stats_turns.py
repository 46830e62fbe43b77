"""Per-turn statistics (`rlcheck.core.stats.turns`, `torch_turns`): each slot against a naive per-token
reference, the torch path against numpy, ranks merged, offenders' turn and offset, nothing without turns,
and the per-turn detector streams (`rlcheck.core.detect.turns`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import DetectorsConfig, build_detectors
from rlcheck.core.stats import StatsConfig, compute, compute_partial, finalize, merge
from rlcheck.core.stats.turns import RATIO_FLOOR
from rlcheck.core.turns_build import Trajectory, Turn


def multi_turn_batch(seed: int = 0, num: int = 12, later_scale: float = 1.0, head_scale: float = 1.0,
                     masked: bool = True, noise: float = 0.02) -> StepBatch:
    """Trajectories of 1-6 turns (turn 0 long), tool replies between, some tokens masked and one NaN."""
    rng = np.random.default_rng(seed)
    trajs = []
    for _ in range(num):
        k = int(rng.integers(1, 7))
        turns, lt = [], []
        for t in range(k):
            n = int(rng.integers(150, 250)) if t == 0 else int(rng.integers(1, 12))
            lr = -rng.exponential(1.0, n)
            d = rng.normal(0, noise, n) * (later_scale if t else 1.0)
            if t:
                d[:4] *= head_scale
            obs = rng.integers(0, 50, int(rng.integers(1, 6))) if t < k - 1 else np.zeros(0, np.int64)
            turns.append(Turn(rng.integers(0, 100, n), lr, observation_ids=obs))
            lt += [np.minimum(lr + d, 0.0), -rng.exponential(3.0, obs.shape[0])]
        mask = None
        if masked:
            layout = np.concatenate([np.concatenate([np.ones(len(t.output_ids), bool), np.zeros(len(t.observation_ids), bool)])
                                     for t in turns])
            mask = layout & (rng.random(layout.shape[0]) > 0.05)
        trajs.append(Trajectory(turns, np.concatenate(lt), mask=mask))
    b = StepBatch.from_turns(trajs, [f"r{i}" for i in range(num)])
    lt = b.logp_train.copy()
    lt[3] = np.nan  # a non-finite token: left out of every statistic
    return dataclasses.replace(b, logp_train=lt)


def naive(batch: StepBatch, cfg: StatsConfig) -> dict[str, float]:
    """The per-slot metrics from a Python loop over tokens."""
    turns, cu = batch.turns, batch.cu_seqlens
    offsets = turns.offsets(cu)
    counts = turns.turn_counts(cu)
    seq = np.repeat(np.arange(batch.num_sequences), np.diff(cu))
    mask = np.ones(batch.num_tokens, bool) if batch.mask is None else batch.mask
    valid = mask & np.isfinite(batch.logp_train) & np.isfinite(batch.logp_rollout) & ~turns.tool
    t = turns.index
    picks = {str(k): t == k for k in range(8)}
    picks.update(last=t == counts[seq] - 1, later=t >= 1, head=(t >= 1) & (offsets < cfg.turn_head_tokens),
                 body=(t >= 1) & (offsets >= cfg.turn_head_tokens))
    out = {}
    for slot, pick in picks.items():
        sel = valid & pick
        out[K.turn_metric(slot, "tokens")] = float(sel.sum())
        if not sel.any():
            continue
        d = batch.logp_train[sel] - batch.logp_rollout[sel]
        ad = np.abs(d)
        out.update({
            K.turn_metric(slot, "abs_diff_mean"): ad.mean(),
            K.turn_metric(slot, "abs_diff_clipped_mean"): np.minimum(ad, cfg.clip).mean(),
            K.turn_metric(slot, "abs_diff_max"): ad.max(),
            K.turn_metric(slot, "diff_mean"): d.mean(),
            K.turn_metric(slot, "kl_k3"): np.mean(np.expm1(d) - d),
            K.turn_metric(slot, "prob_abs_diff_mean"): np.mean(np.abs(np.exp(batch.logp_train[sel])
                                                                      - np.exp(batch.logp_rollout[sel]))),
            K.turn_metric(slot, "catastrophic_frac"): np.mean(ad >= cfg.catastrophic_tau),
        })
    return out


class TestPerTurnStatistics:
    def test_slots_match_a_naive_reference(self):
        """Every slot's statistics equal a per-token loop (masked, tool and non-finite tokens left out)."""
        cfg = StatsConfig()
        b = multi_turn_batch()
        m, _ = compute(b, cfg)
        ref = naive(b, cfg)
        for key, value in ref.items():
            assert m[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert m[K.TURN_COUNT] == b.turns.turn_counts(b.cu_seqlens).sum()
        assert m[K.TURN_TOOL_TOKENS] == np.count_nonzero(b.turns.tool)

    def test_no_turns_no_keys(self):
        """A batch without turns logs no rlcheck/turn/* key (and pays nothing for them)."""
        b = dataclasses.replace(multi_turn_batch(), turns=None)
        m, _ = compute(b)
        assert not [k for k in m if k.startswith(K.TURN_PREFIX)]

    def test_shape_metrics(self):
        """Worst turn, slope, later and head ratios (levels floored by RATIO_FLOOR)."""
        b = multi_turn_batch(later_scale=20.0, seed=1)
        m, _ = compute(b)
        level = {t: m.get(K.turn_metric(t, "abs_diff_clipped_mean")) for t in map(str, range(8))}
        worst = max((v, -int(t)) for t, v in level.items() if v is not None)
        assert m[K.TURN_WORST] == -worst[1] and m[K.TURN_WORST] >= 1
        assert m[K.TURN_SLOPE] > 0
        expected = (m[K.turn_metric("later", "abs_diff_clipped_mean")] + RATIO_FLOOR) / (level["0"] + RATIO_FLOOR)
        assert m[K.TURN_LATER_RATIO] == pytest.approx(expected)
        assert m[K.TURN_LATER_RATIO] > 5

    def test_a_spike_on_later_turns_is_diluted_overall_but_not_per_turn(self):
        """Turn 0 holds most tokens: 3x on the later turns moves the step's mean little, their ratio a lot."""
        base, spiked = compute(multi_turn_batch(seed=2))[0], compute(multi_turn_batch(seed=2, later_scale=3.0))[0]
        overall = spiked[K.ABS_DIFF_CLIPPED_MEAN] / base[K.ABS_DIFF_CLIPPED_MEAN]
        assert overall < 1.5 and spiked[K.TURN_LATER_RATIO] / base[K.TURN_LATER_RATIO] > 1.5

    def test_offenders_carry_turn_and_offset(self):
        """An offender names the turn of its first divergence and the offset in that turn."""
        b = multi_turn_batch(seed=3)
        lt = b.logp_train.copy()
        runs = b.turns.runs(b.cu_seqlens)
        r = int(np.flatnonzero((runs.turn == 1) & (runs.seq > 0))[0])  # sequence 0 holds the NaN
        pos = int(runs.start[r] + 2)
        lt[pos] = b.logp_rollout[pos] - 5.0
        _, offenders = compute(dataclasses.replace(b, logp_train=lt, mask=~b.turns.tool))
        o = next(o for o in offenders if o.index == int(runs.seq[r]))
        assert (o.turn, o.turn_offset) == (1, 2)
        assert o.to_dict()["turn"] == 1

    def test_merge_equals_whole(self):
        """Two halves' partials merged give the whole batch's per-turn metrics (ranks reduce exactly)."""
        b = multi_turn_batch(seed=4)
        cfg = StatsConfig()
        half = b.num_sequences // 2
        merged, _ = finalize(merge([compute_partial(b.select(range(half)), cfg),
                                    compute_partial(b.select(range(half, b.num_sequences)), cfg)]), cfg)
        whole, _ = compute(b, cfg)
        for key in [k for k in whole if k.startswith(K.TURN_PREFIX)]:
            assert merged[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-12), key

    def test_merge_with_a_part_without_turns(self):
        """A part without turns (an empty rank) merges as zeros for the turn sums."""
        b = multi_turn_batch(seed=5)
        plain = dataclasses.replace(b.select([0]), turns=None)
        m, _ = finalize(merge([compute_partial(b), compute_partial(plain)]))
        assert m[K.TURN_COUNT] == compute(b)[0][K.TURN_COUNT]


class TestTorchPath:
    @pytest.mark.parametrize("backend", ["torch-eager"])
    def test_torch_equals_numpy(self, backend):
        """The torch path's per-turn statistics and offenders equal the numpy path's."""
        pytest.importorskip("torch")
        b = multi_turn_batch(seed=6, later_scale=5.0)
        num, off_n = compute(b, StatsConfig(backend="numpy"))
        tor, off_t = compute(b, StatsConfig(backend=backend))
        keys = [k for k in num if k.startswith(K.TURN_PREFIX)]
        assert keys and set(keys) == {k for k in tor if k.startswith(K.TURN_PREFIX)}
        for key in keys:
            assert tor[key] == pytest.approx(num[key], rel=1e-6, abs=1e-9), key
        assert [(o.turn, o.turn_offset) for o in off_t] == [(o.turn, o.turn_offset) for o in off_n]

    def test_device_code_path(self, monkeypatch):
        """The segment reductions a GPU runs (torch.segment_reduce, not numpy's reduceat), run on the CPU."""
        pytest.importorskip("torch")
        from rlcheck.core.stats import torch_kernels as TK

        b = multi_turn_batch(seed=8, later_scale=3.0)
        num, _ = compute(b, StatsConfig(backend="numpy"))
        monkeypatch.setattr(TK, "host_path", lambda device: False)
        tor, _ = compute(b, StatsConfig(backend="torch-eager"))
        for key in [k for k in num if k.startswith(K.TURN_PREFIX)]:
            assert tor[key] == pytest.approx(num[key], rel=1e-6, abs=1e-9), key

    def test_device_batch(self, monkeypatch):
        """A batch from tensors 'on a device' (the GPU path, run on the CPU) with mask-run turns."""
        torch = pytest.importorskip("torch")
        from rlcheck.core import batch_torch

        monkeypatch.setattr(batch_torch, "on_device", lambda x: hasattr(x, "detach"))
        rng = np.random.default_rng(7)
        mask = torch.from_numpy(rng.random((6, 50)) > 0.3)
        lr = torch.from_numpy(-rng.exponential(1.0, (6, 50)))
        lt = lr + torch.from_numpy(rng.normal(0, 0.05, (6, 50)))
        lt = torch.minimum(lt, torch.zeros(()))
        b = StepBatch.from_padded(lr, lt, mask, [f"r{i}" for i in range(6)], turns="mask_runs")
        assert b.device_tensors is not None and b.turns.source == "mask_runs"
        dev, _ = compute(b)
        host, _ = compute(b, StatsConfig(backend="numpy"))
        for key in [k for k in host if k.startswith(K.TURN_PREFIX)]:
            assert dev[key] == pytest.approx(host[key], rel=1e-6, abs=1e-9), key


class TestTurnDetectors:
    def test_turn_z_fires_on_a_later_turn_spike(self):
        """The turns detector (robust z on the ratios) alarms on a later-turn spike after warm-up; the
        step-level detectors see it diluted."""
        dets = build_detectors(DetectorsConfig())
        fired = {}
        for step in range(60):
            m, _ = compute(multi_turn_batch(seed=100 + step, later_scale=4.0 if step == 50 else 1.0, noise=0.003))
            for det in dets.values():
                for a in det.update(step, m):
                    fired.setdefault(a.metric, []).append(step)
        assert fired.get(K.TURN_LATER_RATIO) == [50]
        assert not fired.get(K.ABS_DIFF_CLIPPED_MEAN)
