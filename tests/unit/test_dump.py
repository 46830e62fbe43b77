"""Forensic dumps: their per-sequence max |d| and first divergence are the statistics' (mask included)."""

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
