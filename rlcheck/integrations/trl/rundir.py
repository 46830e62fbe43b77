"""Which run a `train()` writes to. A fresh `train()` starts a new run: an earlier run found in the
run directory (a halted run's, a finished one's) is kept beside it under a new name, said in one
warning line, and never appended to; `train(resume_from_checkpoint=...)` continues the run that is
there (TRL's state is loaded before `on_train_begin`, so its global_step is past 0)."""

from __future__ import annotations

from pathlib import Path

from rlcheck.integrations.rundir import kept_name, set_aside

__all__ = ["kept_name", "start_run"]


def start_run(run_dir: Path, global_step: int) -> Path | None:
    """Before a `train()`'s first step: at global_step 0 an earlier run in `run_dir` is moved aside
    (returns where it went); a resumed `train()` (global_step > 0) keeps it and resumes it."""
    if global_step > 0:
        return None
    return set_aside(run_dir, "this train()", "train(resume_from_checkpoint=...)")
