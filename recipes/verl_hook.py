"""rlcheck inside a verl 0.9 run: compare vLLM's sampling logprobs with the actor's recomputation every step.

verl's driver (the TaskRunner Ray actor) holds the whole step batch, so one Monitor there sees every
sequence; no cross-rank reduction is needed. The hook wraps the trainer's `_compute_old_log_prob`, the
one place where both `rollout_log_probs` and the fresh `old_log_probs` exist, before the rollout
correction rewrites `response_mask` and before the actor update, so a halt stops the run before a bad
step is learned from:

    legacy RayPPOTrainer (trainer.use_v1=False)    observe(batch, logp_train=old_log_probs just computed)
    v1 PPOTrainer (trainer.use_v1=True, default)   fetch the same fields from TransferQueue, as verl's own
                                                   calculate_debug_metrics does, and observe them

The wrapper must be installed in the driver process, which Ray starts; a Ray setup hook does that:

    PYTHONPATH=$PWD/recipes RLCHECK_RUN_DIR=runs/verl-gsm8k python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.rollout.calculate_log_probs=True \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=verl_hook.install \\
        +ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH=$PWD/recipes \\
        +ray_kwargs.ray_init.runtime_env.env_vars.RLCHECK_RUN_DIR=$PWD/runs/verl-gsm8k

(or call `install()` at the top of your own TaskRunner.run). Every Ray worker runs the hook; only the
driver calls the wrapped method, so only it creates a Monitor. With RLCHECK_QUARANTINE=1 (also in
env_vars) the Monitor quarantines instead of halting on a few bad sequences, and the legacy trainer's
batch gets their rows out of `response_mask` before the actor trains on it (the v1 trainer's batch
lives in TransferQueue: there the report says which rows, `report.keep`, but nothing is written back). Not run here: this machine cannot run
verl's trainer (no GPU); the adapter it calls is tested on verl's DataProto in tests/integration/test_verl.py.
With trainer.v1.trainer_mode set to an async mode, rollouts may come from older weights: the mismatch then
includes that staleness, so expect a higher baseline than in sync mode.
"""

from __future__ import annotations

import functools
import os

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.integrations import verl as rlcheck_verl

FIELDS = ["old_log_probs", "rollout_log_probs", "response_mask", "responses"]
_monitor: Monitor | None = None


def monitor() -> Monitor:
    """The driver's Monitor, created on first use (RLCHECK_RUN_DIR, default runs/verl; RLCHECK_QUARANTINE=1:
    quarantine on)."""
    global _monitor
    if _monitor is None:
        run_dir = os.environ.get("RLCHECK_RUN_DIR", "runs/verl")
        quarantine = QuarantineConfig() if os.environ.get("RLCHECK_QUARANTINE") == "1" else None
        _monitor = Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "console"), quarantine=quarantine,
                                         context={"framework": "verl"}))
    return _monitor


def _wrap_legacy(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch):
        old_log_prob, mfu = original(self, batch)
        rlcheck_verl.observe(monitor(), self.global_steps, batch,  # quarantined rows leave its response_mask
                             logp_train=old_log_prob.batch["old_log_probs"])
        return old_log_prob, mfu
    return _compute_old_log_prob


def _wrap_v1(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, metrics):
        batch = original(self, batch, metrics)
        import transfer_queue as tq
        from verl import DataProto

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=FIELDS)
        rlcheck_verl.observe(monitor(), self.global_steps, DataProto(batch=data.to_padded_tensor()),
                             metrics, request_ids=[str(k) for k in batch.keys])
        return batch
    return _compute_old_log_prob


def install() -> list[str]:
    """Wrap `_compute_old_log_prob` of each verl trainer importable here; returns what was wrapped."""
    wrapped = []
    for module, cls, wrap in (("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", _wrap_legacy),
                              ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", _wrap_v1)):
        try:
            trainer = getattr(__import__(module, fromlist=[cls]), cls)
        except ImportError:  # this process lacks that trainer's dependencies: it cannot run it either
            continue
        if not getattr(trainer._compute_old_log_prob, "_rlcheck", False):
            trainer._compute_old_log_prob = wrap(trainer._compute_old_log_prob)
            trainer._compute_old_log_prob._rlcheck = True
        wrapped.append(f"{module}.{cls}")
    return wrapped


if __name__ == "__main__":
    print("wrapped:", install() or "nothing (verl's trainers do not import here)")
