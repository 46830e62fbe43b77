"""Sweep's pure parts without vLLM: knob and size parsing, one knob at a time over the base settings
(with a stand-in for the stress run), the table, its JSON and the plot."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from rlcheck.errors import ConfigError
from rlcheck.forensics import sweep as sweep_module
from rlcheck.forensics.render import show_value
from rlcheck.forensics.slots import SlotContext
from rlcheck.forensics.stress import StressConfig, StressResult
from rlcheck.forensics.stress import report as stress_report
from rlcheck.forensics.stress.report import render_sweep, write_sweep
from rlcheck.forensics.sweep import (
    Knob,
    SweepPoint,
    SweepResult,
    knob_config,
    parse_knob,
    parse_size,
    run_sweep,
)


def fake_stress(cfg: StressConfig, **_) -> StressResult:
    """A stress result shaped like index-wrap: every request fails once max_num_seqs passes the
    boundary; the first wave is max_num_seqs requests."""
    n, wave = cfg.num_requests, cfg.max_num_seqs
    bad = cfg.fault == "index-wrap" and cfg.max_num_seqs > cfg.fault_boundary
    contexts = tuple(SlotContext(i, block=i % wave + 1, block_used=i % wave + 1,
                                 previous=None if i < wave else str(i - wave)) for i in range(n))
    return StressResult(config=cfg, request_ids=tuple(map(str, range(n))),
                        max_abs_diff=tuple(5.0 if bad else 0.0 for _ in range(n)),
                        first_divergence=tuple(1 if bad else None for _ in range(n)), contexts=contexts,
                        fault_affected={}, num_blocks=2 * wave, num_steps=10, trace="slot trace",
                        seconds={"build": 1.0, "generate": 1.0, "score": 0.5})


def sweep_of(points) -> SweepResult:
    return SweepResult(StressConfig(model="models/m", fault="index-wrap", boundary=4), tuple(points))


def point(knob="max_num_seqs", value=8, failing=4, first=0) -> SweepPoint:
    return SweepPoint(knob, value, 16, failing, failing / 16, first if failing else None, 8, min(failing, 8), 9,
                      2.5, tuple(map(str, range(failing))))


class TestParseSize:
    @pytest.mark.parametrize("text, want", [
        ("8388608", 8 << 20), ("8MiB", 8 << 20), ("8M", 8 << 20), ("8mb", 8 << 20), ("700KiB", 700 << 10),
        ("1GiB", 1 << 30), ("1.5MiB", 3 << 19),
    ])
    def test_binary_units(self, text, want):
        """Bytes, or KiB/MiB/GiB in any spelling (binary units)."""
        assert parse_size(text) == want

    @pytest.mark.parametrize("text", ["", "MiB", "8 TB", "-3"])
    def test_refuses(self, text):
        """Anything that is not a size."""
        with pytest.raises(ConfigError, match="not a size"):
            parse_size(text)


class TestParseKnob:
    def test_names_aliases_and_sizes(self):
        """Full names and aliases; kv_cache_bytes values are sizes."""
        assert parse_knob("max_num_seqs=2,4,8") == Knob("max_num_seqs", (2, 4, 8))
        assert parse_knob("kv=700KiB,8MiB") == Knob("kv_cache_bytes", (700 << 10, 8 << 20))
        assert parse_knob("samples=8,128").name == "samples_per_prompt"
        assert parse_knob("batched_tokens=256").name == "max_num_batched_tokens"

    @pytest.mark.parametrize("text", ["max_num_seqs", "temperature=1,2", "max_num_seqs=", "max_num_seqs=2,x",
                                      "max_num_seqs=0,2", "max_num_seqs=2,2"])
    def test_refuses(self, text):
        """No '=', unknown knobs, no values, non-numbers, values < 1, repeated values."""
        with pytest.raises(ConfigError, match="--knob"):
            parse_knob(text)


class TestKnobConfig:
    def test_one_knob_changes(self):
        """The knob takes the value; everything else stays the base's."""
        base = StressConfig(model="m", max_num_seqs=16)
        cfg = knob_config(base, "kv_cache_bytes", 1 << 20)
        assert cfg.kv_cache_bytes == 1 << 20 and cfg.max_num_seqs == 16

    def test_samples_keep_the_number_of_prompts(self):
        """More samples per prompt means more requests, as more rollouts per prompt do in RL."""
        base = StressConfig(model="m", num_requests=64, samples_per_prompt=8)
        cfg = knob_config(base, "samples_per_prompt", 32)
        assert cfg.samples_per_prompt == 32 and cfg.num_requests == 8 * 32


class TestRunSweep:
    def test_one_run_per_value_with_the_boundary_fixed(self, monkeypatch):
        """Each value is a stress run; index-wrap's default boundary is taken from the base, so it does
        not move with max_num_seqs: failures at max_num_seqs > 4, none at <= 4."""
        monkeypatch.setattr(sweep_module, "run_stress", fake_stress)
        base = StressConfig(model="m", num_requests=32, max_num_seqs=8, fault="index-wrap")
        seen = []
        res = run_sweep(base, [parse_knob("max_num_seqs=2,4,8,16")], scorer=object(),
                        progress=lambda phase, d, t: seen.append(phase))
        assert res.base.boundary == 4
        assert [(p.value, p.num_failing) for p in res.points] == [(2, 0), (4, 0), (8, 32), (16, 32)]
        assert res.points[2].first_failing_index == 0 and res.points[2].first_wave == 8

    def test_needs_a_knob(self):
        """No knob: a ConfigError that says how to give one."""
        with pytest.raises(ConfigError, match="--knob"):
            run_sweep(StressConfig(model="m"), [], scorer=object())


class TestWriteSweep:
    def test_json_and_png(self, tmp_path):
        """sweep.json holds the base, the points and the plot's path; sweep.png is a PNG."""
        res = sweep_of([point(value=4, failing=0), point(value=8), point("kv_cache_bytes", 700 << 10, 0)])
        table, png = write_sweep(res, tmp_path / "sw")
        data = json.loads(table.read_text())
        assert [p["value"] for p in data["points"]] == [4, 8, 700 << 10] and data["plot"] == str(png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_without_matplotlib(self, tmp_path, monkeypatch):
        """No matplotlib: the table is still written, the plot is None."""
        def missing(*_):
            raise ImportError("matplotlib")

        monkeypatch.setattr(stress_report, "plot_sweep", missing)
        table, png = write_sweep(sweep_of([point()]), tmp_path)
        assert png is None and json.loads(table.read_text())["plot"] is None


class TestRenderSweep:
    def test_rows(self):
        """One row per value: the knob once per group, sizes in binary units, failures and first wave."""
        console = Console(width=100, record=True)
        render_sweep(sweep_of([point(value=4, failing=0), point(value=8), point("kv_cache_bytes", 8 << 20)]), console)
        text = console.export_text()
        assert text.count("max_num_seqs") == 1 and "8MiB" in text and "4/8" in text and "25.0%" in text

    def test_show_value(self):
        """Cache sizes in the largest unit that divides them."""
        assert show_value("kv_cache_bytes", 8 << 20) == "8MiB" and show_value("kv_cache_bytes", 700 << 10) == "700KiB"
        assert show_value("kv_cache_bytes", 1000) == "1000B" and show_value("max_num_seqs", 8) == "8"
