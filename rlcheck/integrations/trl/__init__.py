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

The package: `hook` (`RLCheckHook`: one Monitor step per generation), `generation` (a generation as a
`StepBatch`), `lifecycle` (the close callback, the halt's log row), `trainer` (`attach_monitor`, the
`RLCheckGRPOTrainer` subclass), `config` (options, refusals, version checks), and `batch`, `loss`,
`sync`, `topk`, `rundir`, `preflight_checks` as above.
"""

from __future__ import annotations

from typing import Any

from rlcheck.integrations.trl.config import TRAINER_METRICS, TRLOptions, check_versions
from rlcheck.integrations.trl.hook import RLCheckHook
from rlcheck.integrations.trl.lifecycle import HALTED_KEY
from rlcheck.integrations.trl.trainer import attach_monitor, trainer_class


def __getattr__(name: str) -> Any:
    if name == "RLCheckGRPOTrainer":  # built on first use: subclassing imports trl
        return trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: F822 (RLCheckGRPOTrainer comes from __getattr__)
    "HALTED_KEY", "TRAINER_METRICS", "RLCheckGRPOTrainer", "RLCheckHook", "TRLOptions", "attach_monitor",
    "check_versions"]
