"""rlcheck inside verl's own trainer, attached as a verl plugin: no verl source edits, no trainer subclass.

    VERL_USE_EXTERNAL_MODULES=rlcheck.integrations.verl.plugin python -m verl.trainer.main_ppo ... \\
        +rlcheck.quarantine=true                 # optional: the `rlcheck` section, settings.py

verl imports its plugins in every process that imports verl (`VERL_USE_EXTERNAL_MODULES`, or the
"verl.plugins" entry point rlcheck's package declares: then the `rlcheck` section alone turns it on).
Loading does nothing but wait for verl's trainer modules (`imports.after_import`); when verl's driver
imports them, their methods are wrapped:

- before the trainer starts anything (legacy `RayPPOTrainer.init_workers`, v1 `PPOTrainer.init`, the
  fully async trainer's `init_workers`): the settings of the `rlcheck` section, the refusals of
  `settings.refusals` (one `ConfigError`: verl's TaskRunner fails before vLLM starts), the static preflight;
- `_compute_old_log_prob`, right after the actor's recomputation and before the advantage, the rollout
  correction and the actor update: `rlcheck.integrations.verl.observe` on the step's rows (legacy and
  fully async: the `DataProto` in hand; v1: the fields read from the TransferQueue, `tq_batch`). Weight
  versions: legacy and v1 as `global_steps`, the fully async trainer as its `current_param_version`.
  A halt raises `MismatchHalt` out of verl's `fit`: the step is not trained on, the run directory holds
  the journal and the dump, and verl's TaskRunner ends with the error (its loggers finished). The
  quarantine and the correction are written into the batch verl trains on (`response_mask`,
  `rollout_is_weights`), so they reach verl's loss;
- verl's logger (`Tracking.log`): rlcheck's metrics of the step go in beside verl's own
  (`training/rollout_probs_diff_*`), under `rlcheck/...` (the v1 trainer takes them into its step
  metrics directly).
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from types import ModuleType
from typing import Any

from rlcheck.integrations.verl.imports import after_import

MODULE = __name__
TRAINERS = (
    ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", "init_workers"),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "init"),
    ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer", "init_workers"),
)
"""(module, class, the method that starts its workers): the trainers rlcheck attaches to."""
_sessions: weakref.WeakSet = weakref.WeakSet()
"""Every live Session of this process: verl's logger takes their pending metrics."""


def _loaded_by_name() -> bool:
    return MODULE in [m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")]


def kind_of(trainer: Any) -> str:
    """"fully_async", "v1" or "legacy": which convention of versions and batches `trainer` follows."""
    if hasattr(trainer, "current_param_version"):
        return "fully_async"
    return "v1" if type(trainer).__module__.startswith("verl.trainer.ppo.v1") else "legacy"


def start(trainer: Any) -> Any:
    """Attach rlcheck to `trainer` before it starts anything: its Session, or None when rlcheck stays out."""
    from rlcheck.integrations import verl as rlcheck_verl
    from rlcheck.integrations.verl.context import verl_context
    from rlcheck.integrations.verl.session import Session
    from rlcheck.integrations.verl.settings import check, settings_of
    from rlcheck.preflight import as_context

    if hasattr(trainer, "_rlcheck"):  # a subclass's start calling its parent's
        return trainer._rlcheck
    settings = settings_of(trainer.config, loaded_by_name=_loaded_by_name())
    session = None
    if settings is not None:
        check(trainer.config, settings)
        findings = rlcheck_verl.preflight(trainer.config)
        # the rollout engine's sampling and settings, in every dump (replay reads the temperature from there)
        session = Session(settings, kind_of(trainer), {**verl_context(trainer.config), "preflight": as_context(findings)},
                          precision=rlcheck_verl.precision(trainer.config))  # the run's floor: gates scale with it
        _sessions.add(session)
    trainer._rlcheck = session
    return session


def _wrap_start(original):
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def started(self, *args, **kwargs):
            start(self)
            return await original(self, *args, **kwargs)
    else:
        @functools.wraps(original)
        def started(self, *args, **kwargs):
            start(self)
            return original(self, *args, **kwargs)
    return started


def _wrap_dataproto_step(original, kind: str):
    """legacy and fully async: `_compute_old_log_prob(batch) -> (old_log_prob, mfu)` on the DataProto."""
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        out = original(self, batch, *args, **kwargs)
        session = getattr(self, "_rlcheck", None)
        if session is None or session.kind != kind:  # a subclass's own wrapper observes
            return out
        logp_train = out[0].batch["old_log_probs"]
        if kind == "fully_async":
            session.observe(self.global_steps, batch, logp_train=logp_train, param_version=self.current_param_version,
                            async_training=self.config.async_training)
        else:
            session.observe(self.global_steps, batch, logp_train=logp_train, global_steps=self.global_steps)
        return out
    return _compute_old_log_prob


def _wrap_v1_step(original):
    """v1: `_compute_old_log_prob(batch: KVBatchMeta, metrics) -> KVBatchMeta`, the rows in the TransferQueue."""
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, metrics, *args, **kwargs):
        out = original(self, batch, metrics, *args, **kwargs)
        session = getattr(self, "_rlcheck", None)
        if session is not None and session.kind == "v1":
            from rlcheck.integrations.verl.tq_batch import observe_v1

            observe_v1(session, self.global_steps, out, metrics)
            metrics.update(session.pending)
            session.pending = {}
        return out
    return _compute_old_log_prob


def _trainer_class(obj: Any) -> type:
    """The class whose methods verl's trainer runs: a Ray actor class (`@ray.remote`, the fully async
    trainer) runs Ray's own subclass of it, which holds a copy of every method and is what Ray sends to
    the actor's process (pickled by value, our wrappers with it)."""
    meta = getattr(obj, "__ray_metadata__", None)
    return obj if meta is None else meta.modified_class


def _attach(cls_name: str, start_method: str, module: ModuleType) -> None:
    trainer = _trainer_class(getattr(module, cls_name))
    if trainer.__dict__.get("_rlcheck_wrapped", False):
        return
    step = trainer.__dict__["_compute_old_log_prob"]
    if module.__name__.startswith("verl.trainer.ppo.v1"):
        trainer._compute_old_log_prob = _wrap_v1_step(step)
    else:
        kind = "fully_async" if cls_name == "FullyAsyncTrainer" else "legacy"
        trainer._compute_old_log_prob = _wrap_dataproto_step(step, kind)
    setattr(trainer, start_method, _wrap_start(trainer.__dict__[start_method]))
    trainer._rlcheck_wrapped = True


def _wrap_tracking(module: ModuleType) -> None:
    """verl's logger gets the pending rlcheck metrics of every live session with the next record it logs."""
    tracking = module.Tracking
    if getattr(tracking.log, "_rlcheck", False):
        return
    original = tracking.log

    @functools.wraps(original)
    def log(self, data, step, *args, **kwargs):
        pending = {}
        for session in list(_sessions):
            pending.update(session.pending)
            session.pending = {}
        return original(self, {**data, **pending} if pending else data, step, *args, **kwargs)

    log._rlcheck = True
    tracking.log = log


def install() -> None:
    """Wrap verl's trainers and logger as they are imported (the module docstring); idempotent."""
    for module, cls_name, start_method in TRAINERS:
        after_import(module, functools.partial(_attach, cls_name, start_method))
    after_import("verl.utils.tracking", _wrap_tracking)


install()
