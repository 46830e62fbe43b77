"""The hook's life around TRL's `train()`: the close callback (a fresh `train()` starts a new run, the
Monitor rlcheck opened closes at the end) and the halt's last log row for TRL's reporters
(`rlcheck.integrations.trl`, "Halting")."""

from __future__ import annotations

import warnings
from typing import Any

from rlcheck.errors import MismatchHalt
from rlcheck.integrations.trl.rundir import start_run

HALTED_KEY = "rlcheck/halted"


def log_halt(hook: Any, halt: MismatchHalt) -> None:
    """TRL's reporters get one last row: the halting step's rlcheck metrics and `rlcheck/halted`."""
    try:
        hook.append_trainer_metrics(halt.report.metrics)
        hook.trainer.log({HALTED_KEY: 1.0})
    except Exception as exc:  # the halt must reach the caller whatever the loggers do
        warnings.warn(f"rlcheck: TRL's log of the halt failed ({exc})", RuntimeWarning, stacklevel=3)


def close_callback(hook: Any) -> Any:
    """A transformers `TrainerCallback` that starts a fresh run on `train()` and closes the Monitor at its end."""
    from transformers import TrainerCallback

    class CloseMonitor(TrainerCallback):
        """A fresh train() starts a new run (`rundir`); the Monitor rlcheck opened closes at the end."""

        def on_train_begin(self, args, state, control, **kwargs):
            if hook._owned and hook.rank == 0:
                hook.close()  # a halted earlier train()'s Monitor is closed already
                start_run(hook.monitor_config.run_dir, state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            hook.close()

    return CloseMonitor()
