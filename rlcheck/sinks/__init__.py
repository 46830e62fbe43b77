"""Views of each step's record: the console, W&B, your own. The record itself is the run's journal,
`metrics.jsonl`, which the Monitor's `Run` always writes (`rlcheck.core.run.journal`); the name
"jsonl" is still accepted in a sink list and means that journal, nothing more.

Every sink gets `log(step, record)` with one record per step:

    {
      "step": int,
      "time": float,                       # unix seconds
      "metrics": {key: float},             # keys from rlcheck.core.metrics
      "alarms": [Alarm.to_dict()],         # kind, metric, step, severity, message, details
      "offenders": [Offender.to_dict()],   # request_id, index, max_abs_diff, first_divergence
                                           #   (int or None), length, mean_diff, nonfinite
      "abs_diff_hist": {"bins": [int], "counts": [int]},  # nonzero bins of histogram.ABS_EDGES
      "events": [dict],                    # optional
    }

    sinks = make_sinks(["console", "wandb"], run_dir, WandbConfig(mode="offline"))
    sinks.log(step, record); ...; sinks.close()

`wandb` and `rich` are imported only when their sink is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcheck.errors import ConfigError
from rlcheck.sinks.base import FanOut, Sink, SinkInitError, SinkWarning
from rlcheck.sinks.console import ConsoleSink
from rlcheck.sinks.wandb import WandbConfig, WandbSink

SINK_NAMES = ("jsonl", "console", "wandb")

__all__ = [
    "SINK_NAMES",
    "ConsoleSink",
    "FanOut",
    "Sink",
    "SinkInitError",
    "SinkWarning",
    "WandbConfig",
    "WandbSink",
    "make_sinks",
]


def make_sinks(
    names: Sequence[str | Sink],
    run_dir: Path,
    wandb_config: WandbConfig | None = None,
    wandb_run: Any = None,
) -> FanOut:
    """A FanOut of the named sinks, in the order given; a `Sink` instance in the list (your own) is
    used as it is. A W&B sink that cannot start is skipped with one SinkWarning (training goes on);
    an unknown or repeated name is a ConfigError."""
    if isinstance(names, str):
        raise ConfigError(f"sink names must be a list such as ['jsonl', 'console'], got the string {names!r}")
    named = [n for n in names if not isinstance(n, Sink)]
    for name in named:
        if name not in SINK_NAMES:
            raise ConfigError(f"unknown sink {name!r}; valid sinks are {', '.join(SINK_NAMES)} or a Sink instance")
    if len(set(named)) != len(named):
        raise ConfigError(f"each sink may be named once, got {list(named)}")

    sinks: list[Sink] = []
    try:
        for name in names:
            sink = name if isinstance(name, Sink) else _make_one(name, Path(run_dir), wandb_config, wandb_run)
            if sink is not None:
                sinks.append(sink)
    except BaseException:
        FanOut(sinks).close()
        raise
    return FanOut(sinks)


def _make_one(name: str, run_dir: Path, wandb_config: WandbConfig | None, wandb_run: Any) -> Sink | None:
    if name == "jsonl":
        return None  # the journal: written by the Run whatever the sinks
    if name == "console":
        return ConsoleSink()
    try:
        return WandbSink(run_dir, wandb_config, run=wandb_run)
    except SinkInitError as e:
        warnings.warn(f"rlcheck: continuing without W&B: {e}", SinkWarning, stacklevel=3)
        return None
