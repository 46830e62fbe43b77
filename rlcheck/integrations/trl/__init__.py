"""TRL: rlcheck's Monitor inside `trl.GRPOTrainer` (TRL 1.16, vLLM colocate or server mode).

    from rlcheck.integrations.trl import RLCheckGRPOTrainer      # drop-in for trl.GRPOTrainer
    trainer = RLCheckGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, ...),
                                 train_dataset=ds, monitor=MonitorConfig(run_dir="runs/grpo"))
    trainer.train()            # raises rlcheck.MismatchHalt when the halt policy fires

    hook = attach_monitor(trainer, MonitorConfig(run_dir="runs/grpo"))   # or: an existing trainer

Every training generation (`_generate_and_score_completions`, once per optimizer step by default)
the Monitor compares vLLM's sampling logprobs (`sampling_per_token_logps`) with the trainer's raw
recomputation under the same weights (`old_per_token_logps`, before TRL clips or masks the ratio it
derives from it) on `completion_mask` (x `tool_mask`). Monitor step = `trainer.state.global_step`
at generation, the number of optimizer updates behind the rollouts (TRL logs that step's metrics as
step + 1). TRL's own `sampling/*` and reward scalars of the step go along as `trl/*` extras, and a few
rlcheck metrics (`TRLOptions.trainer_metrics`) are appended to TRL's logs, so they reach TRL's
reporters (W&B, TensorBoard, console) on TRL's steps. Eval generations are not observed. Request ids
and per-row meta: `rlcheck.integrations.trl.batch`. Sampling settings that make vLLM's logprobs differ
from the trainer's (top_p < 1, top_k > 0, min_p > 0, repetition_penalty != 1) are refused when
attaching, each GRPOConfig field named (`TRLOptions.allow_logit_processing` to go on; see
`rlcheck.integrations.trl.config`). The static preflight (`rlcheck.integrations.trl.preflight_checks`) runs then too,
before vLLM starts: its findings print as one warning block and go into the Monitor's context.

Beyond the sampled token (`TRLOptions(top_logprobs=20)`, or `StatsConfig(distribution=True)`): vLLM returns its
top-K logprobs per completion position, the trainer scores the same ids in one more no-grad forward per
generation, and the Monitor logs `rlcheck/dist/*` (`rlcheck.integrations.trl.topk`).

Quarantine (`MonitorConfig(quarantine=QuarantineConfig())`): the sequences the Monitor condemns leave
TRL's loss, for every `loss_type` as if never sampled (`rlcheck.integrations.trl.loss`); TRL's logs get
the counts (`rlcheck/trl/dropped_sequences`, `rlcheck/trl/dropped_tokens`, over all processes).

Halting: the Monitor flushes its sinks, writes the step's dump and raises `MismatchHalt`; before it
leaves the trainer, TRL gets a last log row (`rlcheck/halted` = 1 and the step's rlcheck metrics)
and a Monitor rlcheck opened itself is closed (its W&B run finished). The exception propagates out
of `trainer.train()` unchanged.

Several processes (accelerate): statistics are reduced over torch.distributed and rank 0 alone runs
the Monitor; a halt stops every rank together and the dump holds every rank's sequences
(`rlcheck.distributed.observe_across_ranks`). Pass a `MonitorConfig` (or nothing) there, so that only rank 0
opens sinks. The vLLM 0.32 weight-sync fix (colocate mode) is `rlcheck.integrations.trl.sync`.
trl is imported when `RLCheckGRPOTrainer` is first used.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.types import StepReport
from rlcheck.errors import MismatchHalt
from rlcheck.faults import Fault, apply_in_loop
from rlcheck.integrations.trl.batch import (
    MASK_KEY,
    mask_rows,
    new_scalars,
    quarantined_rows,
    request_ids,
    row_meta,
    to_step_batch,
)
from rlcheck.integrations.trl.config import (
    DROPPED_SEQUENCES,
    DROPPED_TOKENS,
    TRAINER_METRICS,
    TRLOptions,
    check_fault,
    check_trainer,
    trl_context,
)
from rlcheck.integrations.trl.loss import MULTIMODAL_KEYS, kept_loss, mark_kept
from rlcheck.integrations.trl.preflight_checks import check_attach, check_before_start
from rlcheck.integrations.trl.rundir import start_run
from rlcheck.integrations.trl.sync import WeightSync
from rlcheck.integrations.trl.topk import attach_topk, build_step_topk
from rlcheck.integrations.trl.turns import recorder_for, with_turns
from rlcheck.versions import check_tested

HALTED_KEY = "rlcheck/halted"


class RLCheckHook:
    """The Monitor's side of one GRPOTrainer: `run` wraps each generation; see the module docstring.
    `last_report` is the latest `StepReport` (rank 0's, the same on every rank), `halt` the
    `MismatchHalt` that stopped the run."""

    def __init__(self, trainer: Any, monitor: Monitor | MonitorConfig | None = None,
                 options: TRLOptions | None = None):
        check_versions()
        check_trainer(trainer)
        self.trainer = trainer
        self.options = options or TRLOptions()
        check_attach(trainer, self.options)  # sampling refusals, then the preflight (unless run before vLLM started)
        self.fault = check_fault(self.options.inject)
        self.turns = recorder_for(trainer, self.fault)  # with tools: vLLM's calls, turn by turn
        if monitor is None:
            monitor = MonitorConfig(run_dir=Path(trainer.args.output_dir) / "rlcheck")
        self._owned = isinstance(monitor, MonitorConfig)
        if self._owned:
            monitor = dataclasses.replace(monitor, context={**trl_context(trainer), **monitor.context})
        self.monitor_config = monitor if self._owned else monitor.cfg
        self.monitor_config, self.engine_topk = attach_topk(trainer, self.monitor_config, self.options.top_logprobs,
                                                            self._owned)  # with top-k on: captures vLLM's
        self._monitor = None if self._owned else monitor
        self.rank = trainer.accelerator.process_index
        self.world_size = trainer.accelerator.num_processes
        skip = self.fault.skip_sync if type(self.fault).skip_sync is not Fault.skip_sync else None
        spoil = self.fault.sync_spoil if type(self.fault).sync_spoil is not Fault.sync_spoil else None
        self.sync = WeightSync(trainer.vllm_generation, lambda: trainer.state.global_step,
                               self.options.vllm_sync, skip, check=self.options.sync_check, spoil=spoil,
                               budget=self.options.sync_check_budget)
        self.last_report: StepReport | None = None
        self.halt: MismatchHalt | None = None
        trainer.rlcheck = self
        trainer.add_callback(_close_callback(self))

    @property
    def monitor(self) -> Monitor | None:
        """Rank 0's Monitor (opened on first use when rlcheck owns it); None on the other ranks."""
        if self.rank != 0:
            return None
        if self._monitor is None:
            self._monitor = Monitor(self.monitor_config)
        return self._monitor

    def close(self) -> None:
        """Close the Monitor if rlcheck opened it (a later step opens it again, resuming its state)."""
        if self._owned and self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    def run(self, generate: Callable[[Any], dict], inputs: Any) -> dict:
        """`generate(inputs)` (TRL's `_generate_and_score_completions`), then one Monitor step."""
        mode = "train" if self.trainer.model.training else "eval"
        before = {k: len(v) for k, v in self.trainer._metrics[mode].items()}
        output = generate(inputs)
        rows = self.engine_topk.take() if self.engine_topk is not None else None  # eval's too: forget them
        if mode == "train":
            self.observe(output, new_scalars(before, self.trainer._metrics[mode], self.options.forward_prefixes),
                         topk_rows=rows)
        return output

    def observe(self, output: dict, extra: dict[str, float] | None = None, topk_rows=None) -> StepReport | None:
        """Compare one generation's logprobs; the step's report (on every rank). A generation whose
        completion tokens are all masked out (`mask_truncated_completions`) is logged by the Monitor
        as an empty step, with a warning, and skipped by its detectors. With quarantine on, the
        quarantined sequences' rows of `output["completion_mask"]` are zeroed. With top-k on,
        `topk_rows` are vLLM's top-k of the generation's completions (`EngineTopK.take()`)."""
        step = self.trainer.state.global_step
        batch, _ = apply_in_loop(self.fault, step, self._batch(step, output, topk_rows))  # a turn fault acts for real
        try:
            report = self._observe(step, batch, extra)
        except MismatchHalt as halt:
            self.halt = halt
            self._log_halt(halt)
            self.close()
            raise
        self.last_report = report
        if report is not None:
            self._append_trainer_metrics(report.metrics)
            self._append_trainer_metrics(self._drop_quarantined(step, output, report), (DROPPED_SEQUENCES, DROPPED_TOKENS))
        return report

    # ---- one step ------------------------------------------------------------------------------

    def _batch(self, step: int, output: dict, topk_rows=None):
        rows = output["completion_mask"].shape[0]
        meta = row_meta(self.rank, rows, self.trainer.num_generations, self.sync.synced_step)
        train = None if output.get("old_per_token_logps") is not None else self._recompute(output)
        return with_turns(self, output, to_step_batch(output, request_ids(step, self.rank, rows), logp_train=train,
                          meta=meta, weight_version=self.sync.synced_step, topk=self._topk(output, topk_rows)))

    def _topk(self, output: dict, rows):
        """The step's `TopK` with top-k on (`TRLOptions.top_logprobs`): one more no-grad forward; None when off."""
        if self.engine_topk is None:
            return None
        return build_step_topk(self.trainer, output, rows, self.engine_topk.k)

    def _recompute(self, output: dict):
        """The trainer's logprobs of the sampled tokens, when TRL did not compute them (importance
        sampling off and generation aligned with the optimizer step): one extra no-grad forward."""
        import torch

        tr = self.trainer
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+C)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+C)
        extra = {k: output[k] for k in MULTIMODAL_KEYS if k in output}
        with torch.no_grad():
            logps, _, _ = tr._get_per_token_logps_and_entropies(
                tr.model, ids, attention, output["completion_ids"].size(1),
                batch_size=tr.args.per_device_train_batch_size, **extra,
            )
        return logps

    def _observe(self, step: int, batch, extra) -> StepReport | None:
        # the rollouts' weights are those of the step vLLM was last synced at; the trainer's, this step's;
        # the sync check of that sync (every rank's engine, each its own) judges them too
        alarms, checked = self.sync.take(step)
        extra = {**(extra or {}), **checked}
        if self.world_size == 1:
            return self.monitor.observe(step, batch, extra=extra, alarms=alarms, trainer_version=step)
        from rlcheck.distributed import observe_across_ranks

        cfg = self.monitor_config
        return observe_across_ranks(self.monitor, step, batch, cfg.stats, extra, trainer_version=step,
                                    alarms=alarms, quarantine=cfg.quarantine, max_weight_lag=cfg.max_weight_lag)

    def _drop_quarantined(self, step: int, output: dict, report: StepReport) -> dict[str, float]:
        """Zero this process's quarantined rows of TRL's loss mask and take their tokens out of
        `num_items_in_batch` (a sum over every process, so every process's dropped tokens); what was
        dropped, over all processes ({} when quarantine is off or `mask_quarantined` False)."""
        if self.monitor_config.quarantine is None or not self.options.mask_quarantined:
            return {}
        rows = quarantined_rows(request_ids(step, self.rank, output[MASK_KEY].shape[0]), report.quarantined)
        tokens = mask_rows(output, rows)
        if rows:
            mark_kept(output, rows)  # TRL's loss runs on the kept rows alone (`loss`)
        count = report.metrics.get(K.QUARANTINE_COUNT, 0.0)  # the step's, the same on every process
        if self.world_size > 1 and count:
            import torch

            tokens = int(self.trainer.accelerator.gather(torch.tensor(tokens, device=output[MASK_KEY].device)).sum())
        if tokens and output.get("num_items_in_batch") is not None:
            output["num_items_in_batch"] = output["num_items_in_batch"] - tokens
        return {DROPPED_SEQUENCES: float(count), DROPPED_TOKENS: float(tokens)}

    def _append_trainer_metrics(self, metrics: dict[str, float], keys: tuple[str, ...] | None = None) -> None:
        logged = self.trainer._metrics["train"]
        for key in self.options.trainer_metrics if keys is None else keys:
            if key in metrics:
                logged[key].append(metrics[key])

    def _log_halt(self, halt: MismatchHalt) -> None:
        """TRL's reporters get one last row: the halting step's rlcheck metrics and `rlcheck/halted`."""
        try:
            self._append_trainer_metrics(halt.report.metrics)
            self.trainer.log({HALTED_KEY: 1.0})
        except Exception as exc:  # the halt must reach the caller whatever the loggers do
            warnings.warn(f"rlcheck: TRL's log of the halt failed ({exc})", RuntimeWarning, stacklevel=3)


def _close_callback(hook: RLCheckHook):
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


def check_versions() -> None:
    """Warn once when TRL or vLLM is outside the versions this adapter is tested on (before vLLM starts)."""
    check_tested("trl", what="the TRL adapter (it reads GRPOTrainer's internals)")
    check_tested("vllm", what="the TRL adapter's weight-sync check")


def attach_monitor(trainer: Any, monitor: Monitor | MonitorConfig | None = None,
                   options: TRLOptions | None = None) -> RLCheckHook:
    """Attach rlcheck to an existing `trl.GRPOTrainer` (before `train()`); returns the hook, also
    reachable as `trainer.rlcheck`. `monitor` None: a Monitor in `<output_dir>/rlcheck`."""
    hook = RLCheckHook(trainer, monitor, options)
    trainer._generate_and_score_completions = functools.partial(hook.run, trainer._generate_and_score_completions)
    trainer._compute_loss = functools.partial(kept_loss, trainer._compute_loss, trainer.accelerator)
    return hook


@functools.cache
def _trainer_class() -> type:
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

    RLCheckGRPOTrainer.__module__ = __name__
    RLCheckGRPOTrainer.__qualname__ = "RLCheckGRPOTrainer"
    return RLCheckGRPOTrainer


def __getattr__(name: str) -> Any:
    if name == "RLCheckGRPOTrainer":  # built on first use: subclassing imports trl
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: F822 (RLCheckGRPOTrainer comes from __getattr__)
    "HALTED_KEY", "TRAINER_METRICS", "RLCheckGRPOTrainer", "RLCheckHook", "TRLOptions", "attach_monitor"]
