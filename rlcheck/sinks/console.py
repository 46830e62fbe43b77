"""Terminal output with rich: one compact line per step, one coloured line per alarm.

    step 120  |d| mean 0.0031  p99 0.041  max 1.92  kl_k3 2.4e-05  mpe 1.0031  alarms 1
      CRITICAL signature rlcheck/seq/catastrophic_count: 3 sequences diverged at token 0

A multi-turn step adds `turns 3.2  later/t0 1.04  head/body 0.97  worst turn 2`.
Alarms are printed at every step; the step line every `every` steps and at any step with alarms.
Lines are never wrapped (one line per item in a captured log).
Alarm text goes in as plain text (never parsed as rich markup), so brackets in messages are safe.
"""

from __future__ import annotations

from typing import Any

from rlcheck.core import metrics as K
from rlcheck.errors import ConfigError
from rlcheck.sinks.base import Sink

# (label, key) of the step line, in order
COLUMNS = (
    ("|d| mean", K.ABS_DIFF_MEAN, 4),
    ("p99", K.ABS_DIFF_P99, 4),
    ("max", K.ABS_DIFF_MAX, 4),
    ("kl_k3", K.KL_K3, 3),
    ("mpe", K.MULT_PROB_ERROR, 7),  # near 1: keep the digits that move
)
TURN_COLUMNS = (  # a multi-turn step's (`StepBatch.turns`): turns per sequence, later/turn 0, heads/bodies, worst turn
    ("turns", K.TURN_PER_SEQ_MEAN, 3),
    ("later/t0", K.TURN_LATER_RATIO, 3),
    ("head/body", K.TURN_HEAD_BODY_RATIO, 3),
    ("worst turn", K.TURN_WORST, 1),
)
SEVERITY_STYLE = {"critical": "bold red", "warn": "yellow", "info": "dim"}


def _fmt(value: Any, digits: int) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.{digits}g}"  # nan / inf print as such


class ConsoleSink(Sink):
    """Prints a step summary every `every` steps and every alarm, to `console` (a rich Console;
    default: a new one on stdout)."""

    def __init__(self, every: int = 1, console: Any = None):
        if every < 1:
            raise ConfigError(f"every must be >= 1, got {every}")
        if console is None:
            from rich.console import Console

            console = Console()
        self.every = every
        self.console = console

    def log(self, step: int, record: dict[str, Any]) -> None:
        alarms = record.get("alarms") or []
        if step % self.every == 0 or alarms:
            self.console.print(self._step_line(step, record.get("metrics") or {}, len(alarms)), soft_wrap=True)
        for alarm in alarms:
            self.console.print(self._alarm_line(alarm), soft_wrap=True)

    def flush(self) -> None:
        file = getattr(self.console, "file", None)
        if file is not None and hasattr(file, "flush"):
            file.flush()

    def _step_line(self, step: int, metrics: dict[str, Any], num_alarms: int) -> Any:
        from rich.text import Text

        line = Text.assemble(("step ", "bold"), (str(step), "bold"))
        for label, key, digits in COLUMNS:
            line.append(f"  {label} ", style="dim")
            line.append(_fmt(metrics.get(key), digits))
        for label, key, digits in TURN_COLUMNS if K.TURN_COUNT in metrics else ():
            line.append(f"  {label} ", style="dim")
            line.append(_fmt(metrics.get(key), digits))
        line.append("  alarms ", style="dim")
        line.append(str(num_alarms), style="bold red" if num_alarms else "")
        return line

    def _alarm_line(self, alarm: dict[str, Any]) -> Any:
        from rich.text import Text

        severity = str(alarm.get("severity", "info"))
        style = SEVERITY_STYLE.get(severity, "")
        return Text.assemble(
            "  ",
            (f"{severity.upper():<8s}", style),
            " ",
            (f"{alarm.get('kind', '?')} {alarm.get('metric', '')}: ", style),
            (str(alarm.get("message", "")), style),
        )
