"""A multi-turn run in every view: the journal, the console line, W&B (read back offline) under
`rlcheck/turn/`, the HTML report's Turns section, the dumps' turn columns, and diagnose from a dump alone."""

from __future__ import annotations

import dataclasses
import io
import json
import warnings

import pytest

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.run.dump import read_dump
from rlcheck.errors import MismatchHalt
from rlcheck.faults.turns import RetokenizedHistory
from rlcheck.forensics.diagnose import diagnose
from rlcheck.report import write_report
from rlcheck.sinks import ConsoleSink, WandbConfig
from rlcheck.sinks.testing import read_offline_run
from rlcheck.sinks.wandb import OFFENDER_COLUMNS
from rlcheck.synthetic.field import FieldConfig
from rlcheck.synthetic.turns import MultiTurnConfig, MultiTurnStream

SMALL = MultiTurnConfig(field=FieldConfig(num_sequences=6, seed=21), first_length=60, turn_length=12,
                        observation_length=8)


def run(run_dir, fault=None, steps: int = 6, sinks=(), **cfg):
    stream = MultiTurnStream(SMALL, fault=fault, num_steps=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = Monitor(MonitorConfig(run_dir, sinks=sinks, **cfg))
        try:
            for i in range(steps):
                mon.observe(i, stream.batch(i), trainer_version=stream.trainer_version(i))
        except MismatchHalt:
            pass
        mon.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class TestViews:
    def test_journal_and_console(self, tmp_path):
        """Every step's record holds the per-turn statistics; the console line shows turns and ratios."""
        from rich.console import Console

        out = io.StringIO()
        records = run(tmp_path / "r", sinks=(ConsoleSink(console=Console(file=out, width=400)),))
        assert all(K.turn_metric("0", "abs_diff_clipped_mean") in r["metrics"] for r in records)
        assert all(r["metrics"][K.turn_invariant("prefix_break")] == 0 for r in records)
        assert "turns " in out.getvalue() and "later/t0" in out.getvalue() and "head/body" in out.getvalue()

    def test_wandb_under_turn_prefix(self, tmp_path, monkeypatch):
        """W&B holds the rlcheck/turn/* scalars and the offenders' turn columns (offline run read back)."""
        pytest.importorskip("wandb")
        for var, sub in [("WANDB_DIR", ""), ("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"),
                         ("WANDB_CONFIG_DIR", "config")]:
            monkeypatch.setenv(var, str(tmp_path / sub))
        monkeypatch.setenv("WANDB_MODE", "offline")
        run(tmp_path / "r", steps=3, sinks=("wandb",), wandb=WandbConfig(mode="offline"))
        (wandb_file,) = (tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb")
        try:
            records = read_offline_run(wandb_file.parent)
        except RuntimeError as exc:
            pytest.skip(str(exc))
        rows = [r["history"]["item"] for r in records if r["type"] == "history"]
        assert len(rows) == 3 and all(K.TURN_LATER_RATIO in row and K.turn_metric("last", "tokens") in row
                                      for row in rows)
        assert "turn" in OFFENDER_COLUMNS and "turn_offset" in OFFENDER_COLUMNS

    def test_report_turns_section(self, tmp_path):
        """The report draws the per-turn plot and heat map and counts the invariants broken."""
        run(tmp_path / "r", RetokenizedHistory(start=3), quarantine=QuarantineConfig(max_frac=0.9))
        page = write_report(tmp_path / "r").read_text()
        assert "<h2>Turns</h2>" in page and "clipped mean |d| per turn</figcaption>" in page
        assert "per turn and step" in page and ">prefix_break<" in page and "<th>offset in turn</th>" in page

    def test_dump_and_diagnose_from_it(self, tmp_path):
        """A halt's dump holds the turn columns; diagnose on the dump alone names the cause."""
        run(tmp_path / "r", dataclasses.replace(RetokenizedHistory(), start=2))
        (dump,) = (tmp_path / "r" / "dumps").iterdir()
        rows, meta = read_dump(dump)
        assert meta["turns"]["source"] == "explicit"
        assert all(len(r["turn_index"]) == len(r["logp_rollout"]) and r["turn_count"] >= 2 for r in rows)
        assert diagnose(dump).verdict.cause == "retokenized_history"
