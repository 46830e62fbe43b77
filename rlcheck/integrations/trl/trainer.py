"""rlcheck attached to TRL's trainer: `attach_monitor` on an existing `trl.GRPOTrainer`, and the drop-in
subclass `RLCheckGRPOTrainer` (built on first use: subclassing imports trl)."""

from __future__ import annotations

import functools
from typing import Any

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.integrations.trl.config import TRLOptions, check_fault, check_versions
from rlcheck.integrations.trl.hook import RLCheckHook
from rlcheck.integrations.trl.loss import kept_loss
from rlcheck.integrations.trl.preflight_checks import check_before_start


def attach_monitor(trainer: Any, monitor: Monitor | MonitorConfig | None = None,
                   options: TRLOptions | None = None) -> RLCheckHook:
    """Attach rlcheck to an existing `trl.GRPOTrainer` (before `train()`); returns the hook, also
    reachable as `trainer.rlcheck`. `monitor` None: a Monitor in `<output_dir>/rlcheck`."""
    hook = RLCheckHook(trainer, monitor, options)
    trainer._generate_and_score_completions = functools.partial(hook.run, trainer._generate_and_score_completions)
    trainer._compute_loss = functools.partial(kept_loss, trainer._compute_loss, trainer.accelerator)
    return hook


@functools.cache
def trainer_class() -> type:
    """The `RLCheckGRPOTrainer` class (see the module docstring), built once."""
    from trl import GRPOTrainer

    class RLCheckGRPOTrainer(GRPOTrainer):
        """`trl.GRPOTrainer` with rlcheck's Monitor attached: same arguments, plus `monitor` (a
        `MonitorConfig`, a `Monitor`, or None for `<output_dir>/rlcheck`) and `rlcheck_options`
        (`TRLOptions`). `trainer.rlcheck` is the `RLCheckHook`."""

        def __init__(self, *args: Any, monitor: Monitor | MonitorConfig | None = None,
                     rlcheck_options: TRLOptions | None = None, **kwargs: Any):
            self.rlcheck = None
            check_versions()
            config = kwargs.get("args", args[2] if len(args) > 2 else None)
            options = rlcheck_options or TRLOptions()
            check_fault(options.inject)  # refuse what the settings alone show before vLLM starts
            self.rlcheck_preflight = check_before_start(config, options, args, kwargs)  # config refusals, preflight
            super().__init__(*args, **kwargs)
            RLCheckHook(self, monitor, rlcheck_options)

        def _generate_and_score_completions(self, inputs):
            if self.rlcheck is None:  # not attached yet (during __init__)
                return super()._generate_and_score_completions(inputs)
            return self.rlcheck.run(super()._generate_and_score_completions, inputs)

        def _compute_loss(self, model, inputs):
            return kept_loss(super()._compute_loss, self.accelerator, model, inputs)

    RLCheckGRPOTrainer.__module__ = "rlcheck.integrations.trl"
    RLCheckGRPOTrainer.__qualname__ = "RLCheckGRPOTrainer"
    return RLCheckGRPOTrainer
