"""Tests of rlcheck.sinks.console: the rich terminal output."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from rlcheck.sinks import ConsoleSink
from rlcheck.sinks.testing import example_record


def _sink(every: int = 1) -> tuple[ConsoleSink, io.StringIO]:
    out = io.StringIO()
    return ConsoleSink(every=every, console=Console(file=out, width=120)), out


class TestConsoleSink:
    def test_step_line_and_alarm(self):
        """The output holds the step, its metrics and each alarm message, one alarm per line."""
        sink, out = _sink()
        sink.log(42, example_record(42, abs_diff_mean=0.0031, alarms=2))
        text = out.getvalue()
        lines = text.splitlines()
        assert len(lines) == 3
        assert "step 42" in lines[0] and "0.0031" in lines[0] and "alarms 2" in lines[0]
        assert "CRITICAL" in lines[1] and "above limit at step 42 [#0]" in lines[1]
        assert "WARN" in lines[2] and "[#1]" in lines[2]

    def test_every_skips_quiet_steps(self):
        """With every=10, only multiples of 10 and steps with alarms print a step line."""
        sink, out = _sink(every=10)
        for step in range(1, 21):
            sink.log(step, example_record(step, alarms=int(step == 7)))
        steps = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("step")]
        assert steps == ["7", "10", "20"]

    def test_missing_and_nonfinite_metrics(self):
        """Absent metrics print as '-', non-finite ones as nan/inf."""
        sink, out = _sink()
        sink.log(0, {"step": 0, "metrics": {"rlcheck/token/abs_diff_max": float("inf")}})
        assert "max inf" in out.getvalue() and "p99 -" in out.getvalue()

    def test_invalid_every(self):
        """every below 1 is a ValueError."""
        with pytest.raises(ValueError, match="every"):
            ConsoleSink(every=0, console=Console(file=io.StringIO()))
