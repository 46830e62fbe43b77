"""Which run a `train()` writes to. A fresh `train()` starts a new run: an earlier run found in the
run directory (a halted run's, a finished one's) is kept beside it under a new name, said in one
warning line, and never appended to; `train(resume_from_checkpoint=...)` continues the run that is
there (TRL's state is loaded before `on_train_begin`, so its global_step is past 0)."""

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


def start_run(run_dir: Path, global_step: int) -> Path | None:
    """Before a `train()`'s first step: at global_step 0 an earlier run in `run_dir` is moved aside
    (returns where it went); a resumed `train()` (global_step > 0) keeps it and resumes it."""
    run_dir = Path(run_dir)
    if global_step > 0 or not (run_dir / STATE_FILE).exists():
        return None
    kept = kept_name(run_dir)
    run_dir.rename(kept)
    warnings.warn(f"rlcheck: {run_dir} held an earlier run; it is kept as {kept} and this train() starts a "
                  "new run (train(resume_from_checkpoint=...) continues the run instead)", UserWarning, stacklevel=2)
    return kept
