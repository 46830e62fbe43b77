"""Forensic dumps: their per-sequence max |d| and first divergence are the statistics' (mask included); MoE routing columns."""

from __future__ import annotations

import numpy as np

from rlcheck import HaltConfig, Monitor, MonitorConfig, StepBatch
from rlcheck.core.run.dump import read_dump, write_dump
from rlcheck.core.stats import StatsConfig


def masked_batch() -> StepBatch:
    """Six sequences whose masked-out tokens hold the largest |d|, a NaN, and early divergences that
    the valid tokens do not have; one sequence is masked out whole, one is empty."""
    rng = np.random.default_rng(5)
    lens = [12, 9, 15, 7, 10, 0]
    lr = [-rng.exponential(1.0, n) for n in lens]
    lt = [np.minimum(x + rng.normal(0, 0.05, n), 0.0) for x, n in zip(lr, lens, strict=True)]
    masks = [np.ones(n, bool) for n in lens]
    lt[0][1] -= 5.0  # masked (below): |d| 5 at position 1
    lt[0][8] -= 0.9  # valid divergence at 8
    lt[1][0] = np.nan  # masked NaN
    lt[1][3] -= 0.7  # valid divergence at 3
    lt[2][:4] -= 3.0  # masked prefix far off; the rest close
    masks[0][1] = masks[1][0] = False
    masks[2][:4] = False
    lt[3][5] = np.nan  # a valid NaN: non-finite, first divergence at 5
    masks[4][:] = False  # every token masked
    return StepBatch.from_ragged(lr, lt, [f"s{i}" for i in range(6)], mask=masks)


class TestDumpPerSequence:
    def test_dump_equals_offenders_of_masked_batch(self, tmp_path):
        """Every dumped sequence's max |d| and first divergence equal the step's offender for it."""
        batch = masked_batch()
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), stats=StatsConfig(top_k=10),
                            halt=HaltConfig(enabled=False))
        with Monitor(cfg) as mon:
            report = mon.observe(0, batch)
            rows, _ = read_dump(mon.dump(0, batch, report))
        offenders = {o.index: o for o in report.offenders}
        assert sorted(offenders) == list(range(6))
        got = [(r["max_abs_diff"], r["first_divergence"]) for r in rows]
        assert got == [(offenders[i].max_abs_diff, offenders[i].first_divergence) for i in range(6)]
        assert [r["first_divergence"] for r in rows] == [8, 3, None, 5, None, None]
        assert rows[0]["max_abs_diff"] < 1.5 and rows[2]["max_abs_diff"] < 0.5 and rows[4]["max_abs_diff"] == 0.0

    def test_tau_is_the_dumps(self, tmp_path):
        """write_dump's divergence_tau sets the first divergence, over valid tokens only."""
        rows, _ = read_dump(write_dump(tmp_path / "d", masked_batch(), step=0, divergence_tau=0.8))
        assert [r["first_divergence"] for r in rows] == [8, None, None, 5, None, None]


def routed_batch() -> StepBatch:
    """Three sequences (3, 0 and 4 tokens) over 2 MoE layers of top-2 routing: the trainer sends token 4
    (sequence 2's second) elsewhere at layer 1, token 5 (sequence 2's third) to the same experts in
    another order at layer 0, and token 6 elsewhere at layer 0 but masked out; token 2 has a NaN."""
    from rlcheck.core.moe import Routing

    rng = np.random.default_rng(3)
    lens = [3, 0, 4]
    rollout = np.stack([rng.permutation(8)[:4].reshape(2, 2) for _ in range(sum(lens))])  # (7, 2, 2)
    train = rollout.copy()
    train[4, 1] = [9, 10]
    train[5, 0] = train[5, 0, ::-1]
    train[6, 0] = [11, 12]
    lr = [-np.linspace(0.1, 1.0, n) for n in lens]
    lt = [x - 0.01 for x in lr]
    lt[0][2] = np.nan
    masks = [np.ones(n, bool) for n in lens]
    masks[2][3] = False
    return StepBatch.from_ragged(lr, lt, ["a", "b", "c"], mask=masks, routing=Routing(rollout, train))


class TestDumpRouting:
    def test_columns_round_trip(self, tmp_path):
        """Each sequence's experts of both sides come back (T, L, k) as written; its agreement and first
        differing MoE layer count the kept tokens only (an order swap agrees; a NaN token still routes);
        meta.json says L and k."""
        batch = routed_batch()
        rows, meta = read_dump(write_dump(tmp_path / "d", batch, step=3))
        assert meta["routing"] == {"moe_layers": 2, "top_k": 2}
        cu = batch.cu_seqlens
        for i, row in enumerate(rows):
            assert row["experts_rollout"].shape == row["experts_train"].shape == (cu[i + 1] - cu[i], 2, 2)
            np.testing.assert_array_equal(row["experts_rollout"], batch.routing.experts_rollout[cu[i]:cu[i + 1]])
            np.testing.assert_array_equal(row["experts_train"], batch.routing.experts_train[cu[i]:cu[i + 1]])
        assert [r["route_agree_frac"] for r in rows] == [1.0, None, 2 / 3]
        assert [r["first_route_diff_layer"] for r in rows] == [None, None, 1]

    def test_redaction_keeps_routing_and_plain_batches_have_none(self, tmp_path):
        """A redacted dump keeps the routing columns (expert ids are not text); a batch without routing
        writes none of them and no `routing` in meta.json."""
        rows, meta = read_dump(write_dump(tmp_path / "r", routed_batch(), step=0, redact=True))
        assert rows[2]["response_tokens"] is None and rows[2]["first_route_diff_layer"] == 1
        assert rows[2]["experts_train"].shape == (4, 2, 2) and meta["redacted"] and meta["routing"]["top_k"] == 2
        rows, meta = read_dump(write_dump(tmp_path / "p", masked_batch(), step=0))
        assert "routing" not in meta
        assert not {"experts_rollout", "experts_train", "route_agree_frac", "first_route_diff_layer"} & rows[0].keys()

    def test_quarantine_dump_keeps_the_quarantined_sequences_routing(self, tmp_path):
        """The quarantine dump (the same writer, the quarantined sequences alone) carries their routing."""
        from rlcheck.core.quarantine import QuarantineConfig
        from rlcheck.core.run.dump import quarantine_dir

        batch = routed_batch()
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), quarantine=QuarantineConfig(rules=("nonfinite",)),
                            halt=HaltConfig(enabled=False))
        with Monitor(cfg) as mon:
            mon.observe(0, batch)
        rows, meta = read_dump(quarantine_dir(tmp_path / "run", 0))
        assert [r["request_id"] for r in rows] == ["a"] and meta["routing"] == {"moe_layers": 2, "top_k": 2}
        np.testing.assert_array_equal(rows[0]["experts_train"], batch.routing.experts_train[:3])


class TestReadDumpArrays:
    """Issue 42 item 9: `read_dump` hands the per-token columns back as numpy slices of one flat array per
    column (no Python float per token), the meta columns as given."""

    def test_token_columns_are_views_of_one_array(self, tmp_path):
        """logp_rollout, logp_train, mask and the token ids of every row are numpy views of a shared
        buffer with the values written; a list meta column stays a Python list."""
        batch = masked_batch()
        batch = StepBatch.from_packed(batch.logp_rollout, batch.logp_train, batch.cu_seqlens, batch.request_ids,
                                      mask=batch.mask, tokens=np.arange(batch.num_tokens),
                                      meta={"tags": [["a"], [], ["b", "c"], [], [], ["d"]]})
        rows, _ = read_dump(write_dump(tmp_path / "d", batch, step=0))
        cu = batch.cu_seqlens
        for i, row in enumerate(rows):
            for key, want in (("logp_rollout", batch.logp_rollout), ("logp_train", batch.logp_train),
                              ("mask", batch.mask), ("response_tokens", batch.tokens)):
                assert isinstance(row[key], np.ndarray) and row[key].base is not None, key
                np.testing.assert_array_equal(row[key], want[cu[i]:cu[i + 1]])
            assert row["logp_rollout"].dtype == np.float64 and row["mask"].dtype == bool
            assert isinstance(row["tags"], list)
        assert rows[0]["prompt_tokens"] is None  # a null column stays None
