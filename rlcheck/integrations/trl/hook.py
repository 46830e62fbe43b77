"""The Monitor's side of one `trl.GRPOTrainer`: `RLCheckHook.run` wraps each generation, compares its
logprobs (one Monitor step, over every process), hands the quarantine to TRL's loss and appends rlcheck's
metrics to TRL's logs (`rlcheck.integrations.trl`, the module docstring, says what and when)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.types import StepReport
from rlcheck.errors import MismatchHalt
from rlcheck.faults import Fault, apply_in_loop
from rlcheck.integrations.trl.batch import MASK_KEY, mask_rows, new_scalars, quarantined_rows, request_ids
from rlcheck.integrations.trl.config import (
    DROPPED_SEQUENCES,
    DROPPED_TOKENS,
    TRLOptions,
    check_fault,
    check_trainer,
    check_versions,
    trl_context,
)
from rlcheck.integrations.trl.floor import LowCopy, floor_sample
from rlcheck.integrations.trl.generation import generation_batch, trainer_logps
from rlcheck.integrations.trl.lifecycle import close_callback, log_halt
from rlcheck.integrations.trl.loss import mark_kept
from rlcheck.integrations.trl.preflight_checks import check_attach
from rlcheck.integrations.trl.sync import WeightSync
from rlcheck.integrations.trl.topk import attach_topk
from rlcheck.integrations.trl.turns import recorder_for, with_turns


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
        self.low = LowCopy()  # the policy in vLLM's coarser dtype, for the measured floor
        trainer.rlcheck = self
        trainer.add_callback(close_callback(self))

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
        train = trainer_logps(self.trainer, output)
        batch = with_turns(self, output, generation_batch(self.trainer, output, step, self.rank, self.sync.synced_step,
                                                          train, self.engine_topk, topk_rows))
        batch, _ = apply_in_loop(self.fault, step, batch)  # a turn fault acts for real (in the tool loop)
        sample = self._floor_sample(output, train)
        try:
            report = self._observe(step, batch, extra, sample)
        except MismatchHalt as halt:
            self.halt = halt
            log_halt(self, halt)
            self.close()
            raise
        self.last_report = report
        if report is not None:
            self.append_trainer_metrics(report.metrics)
            self.append_trainer_metrics(self._drop_quarantined(step, output, report), (DROPPED_SEQUENCES, DROPPED_TOKENS))
        return report

    # ---- one step ------------------------------------------------------------------------------

    def _floor_sample(self, output: dict, train: Any) -> float | None:
        """This generation's measured floor against the trainer's logprobs `train` (`rlcheck.integrations.trl.floor`);
        None: not measured."""
        if not self.options.measure_floor:
            return None
        cfg = self.monitor_config
        return floor_sample(self.trainer, output, train, cfg.precision or Precision.from_context(cfg.context),
                            self.low, cfg.stats.clip)

    def _observe(self, step: int, batch, extra, sample: float | None = None) -> StepReport | None:
        # the rollouts' weights are those of the step vLLM was last synced at; the trainer's, this step's;
        # the sync check of that sync (every rank's engine, each its own) judges them too
        alarms, checked = self.sync.take(step)
        extra = {**(extra or {}), **checked}
        if self.world_size == 1:
            return self.monitor.observe(step, batch, extra=extra, alarms=alarms, trainer_version=step,
                                        floor_sample=sample)
        from rlcheck.distributed import observe_across_ranks

        cfg = self.monitor_config
        return observe_across_ranks(self.monitor, step, batch, cfg.stats, extra, trainer_version=step,
                                    alarms=alarms, quarantine=cfg.quarantine, max_weight_lag=cfg.max_weight_lag,
                                    correction=cfg.correction, floor_sample=sample)

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

    def append_trainer_metrics(self, metrics: dict[str, float], keys: tuple[str, ...] | None = None) -> None:
        """Append `metrics` under `keys` (default `TRLOptions.trainer_metrics`) to TRL's logs of the step."""
        logged = self.trainer._metrics["train"]
        for key in self.options.trainer_metrics if keys is None else keys:
            if key in metrics:
                logged[key].append(metrics[key])
