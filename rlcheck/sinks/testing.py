"""Helpers to test code that consumes or produces sink records: a sink that keeps what it gets,
and a well-formed example record.

    from rlcheck.sinks.testing import RecordingSink, example_record
    sink = RecordingSink()
    mon = Monitor(MonitorConfig(run_dir=..., sinks=("jsonl", sink))); ...; assert sink.records[-1]["alarms"]
    records = read_offline_run(run_dir)   # a W&B offline run read back, one dict per record
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.types import Alarm, Offender
from rlcheck.sinks.base import Sink


class RecordingSink(Sink):
    """Keeps every (step, record) it is given; counts flushes; remembers whether it was closed."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.records: list[dict[str, Any]] = []
        self.num_flushes = 0
        self.closed = False

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.steps.append(step)
        self.records.append(record)

    def flush(self) -> None:
        self.num_flushes += 1

    def close(self) -> None:
        self.closed = True


def example_record(step: int, abs_diff_mean: float = 0.01, alarms: int = 0) -> dict[str, Any]:
    """A record as the monitor logs it: a few metrics, two offenders, a |d| histogram, and
    `alarms` alarms (threshold, then robust_z, alternating; critical, then warn)."""
    return {
        "step": step,
        "time": time.time(),
        "metrics": {
            K.ABS_DIFF_MEAN: abs_diff_mean,
            K.ABS_DIFF_P99: 8 * abs_diff_mean,
            K.ABS_DIFF_MAX: 40 * abs_diff_mean,
            K.KL_K3: abs_diff_mean**2 / 2,
            K.MULT_PROB_ERROR: 1.0 + abs_diff_mean,
            K.TOKEN_COUNT: 1000.0,
        },
        "alarms": [
            Alarm(
                kind=("threshold", "robust_z")[i % 2],
                metric=K.ABS_DIFF_MAX,
                step=step,
                severity=("critical", "warn")[i % 2],
                message=f"abs_diff_max {40 * abs_diff_mean:.3g} above limit at step {step} [#{i}]",
                details={"limit": 0.1},
            ).to_dict()
            for i in range(alarms)
        ],
        "offenders": [
            Offender(f"req-{step}-0", 3, 40 * abs_diff_mean, 0, 128, -abs_diff_mean).to_dict(),
            Offender(f"req-{step}-1", 7, 2 * abs_diff_mean, None, 64, abs_diff_mean).to_dict(),
        ],
        "abs_diff_hist": {"bins": [300, 420, 421], "counts": [900, 90, 10]},
    }


def read_offline_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a W&B offline run directory (offline-run-*), read with `wandb leet inspect
    --json`; raises RuntimeError if this wandb cannot read runs back."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    if subprocess.run([*cmd[:5], "--help"], capture_output=True).returncode != 0:
        raise RuntimeError("this wandb has no `wandb leet inspect` to read runs back")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]
