"""`rlcheck report RUN_DIR`: one self-contained HTML page about a run, to read or to attach to a bug.

    from rlcheck.report import write_report
    path = write_report("runs/exp1")          # runs/exp1/report.html

The page holds the diagnosis, the run's context, the alarms, the metrics per step with the alarm
steps marked, the periodic detector's periodogram, the |d| histogram, the offenders, the engine
guard's violations when the run directory holds guard output, an MoE run's routing agreement (when its
records carry `rlcheck/moe/*`), the first divergent decoder layer of each dump `rlcheck localize` has
run on, and links to the dumps. Modules: `data` collects the run
(existing readers only), `periodogram` replays the periodic detector, `plots` draws inline SVG
(matplotlib), `guard` and `localize` render those sections, `html` lays out the page.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlcheck.core.run.files import atomic_write_text
from rlcheck.errors import RunDirError

FILENAME = "report.html"


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the report of `run_dir` to `out` (default: run_dir/report.html) and return its path.
    A missing run directory, or one without step records, is an `InputError`."""
    from rlcheck.report.data import collect
    from rlcheck.report.html import render

    data = collect(run_dir)
    out = Path(out) if out is not None else data.run_dir / FILENAME
    page = render(data, out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, page, durable=False)
    except OSError as exc:
        raise RunDirError(f"cannot write the report to {out}: {exc}") from None
    return out


__all__ = ["FILENAME", "write_report"]
