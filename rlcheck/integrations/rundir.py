"""Which run a framework's fresh training writes to (the TRL and verl adapters): an earlier run found in
the run directory (a halted run's, a finished one's) is kept beside it under a new name, said in one
warning line, and never appended to; a training the framework resumed from its checkpoint continues
the run that is there."""

from __future__ import annotations

import warnings
from pathlib import Path

from rlcheck.core.run.files import STATE_FILE


def kept_name(run_dir: Path) -> Path:
    """The first free `<run_dir>.prev-N` beside `run_dir`."""
    n = 1
    while (candidate := run_dir.with_name(f"{run_dir.name}.prev-{n}")).exists():
        n += 1
    return candidate


def set_aside(run_dir: Path, starts: str, resumes: str) -> Path | None:
    """Move an earlier run in `run_dir` aside (returns where it went; None when there was none), with one
    warning naming `starts` (what starts a new run) and `resumes` (what would have continued it)."""
    run_dir = Path(run_dir)
    if not (run_dir / STATE_FILE).exists():
        return None
    kept = kept_name(run_dir)
    run_dir.rename(kept)
    warnings.warn(f"rlcheck: {run_dir} held an earlier run; it is kept as {kept} and {starts} starts a new run "
                  f"({resumes} continues the run instead)", UserWarning, stacklevel=3)
    return kept
