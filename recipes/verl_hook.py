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
verl's own step counter goes in as `global_steps` (step G's rows carry the weights of the sync at the
end of step G-1). The fully async trainer (`verl.experimental.fully_async_policy`) is observed with its
`current_param_version` and `async_training` settings: only the rows generated entirely on the trainer's
weights are compared, and a row lagging more than ceil(staleness_threshold) + partial_rollout versions
halts (`rlcheck.integrations.verl.fully_async`).
"""

from __future__ import annotations

import functools
import os

from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.integrations import verl as rlcheck_verl
from rlcheck.preflight import as_context

FIELDS = ["old_log_probs", "rollout_log_probs", "response_mask", "responses"]
_monitor: Monitor | None = None
_preflight: tuple = ()  # the static preflight's findings, recorded in the Monitor's context
_precision = None  # the two sides' dtypes (rlcheck.core.floors.Precision), read with the preflight


def monitor() -> Monitor:
    """The driver's Monitor, created on first use (RLCHECK_RUN_DIR, default runs/verl; RLCHECK_QUARANTINE=1:
    quarantine on)."""
    global _monitor
    if _monitor is None:
        run_dir = os.environ.get("RLCHECK_RUN_DIR", "runs/verl")
        quarantine = QuarantineConfig() if os.environ.get("RLCHECK_QUARANTINE") == "1" else None
        _monitor = Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl", "console"), quarantine=quarantine,
                                         precision=_precision,
                                         context={"framework": "verl", "preflight": as_context(_preflight)}))
    return _monitor


def _wrap_legacy(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch):
        old_log_prob, mfu = original(self, batch)
        if hasattr(self, "current_param_version"):  # the fully async trainer: its own wrapper observes
            return old_log_prob, mfu
        rlcheck_verl.observe(monitor(), self.global_steps, batch,  # quarantined rows leave its response_mask
                             logp_train=old_log_prob.batch["old_log_probs"], global_steps=self.global_steps,
                             config=self.config)
        return old_log_prob, mfu
    return _compute_old_log_prob


def _wrap_fully_async(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch):
        old_log_prob, mfu = original(self, batch)
        # old_log_probs come from the weights of current_param_version; rows generated on other versions are
        # left out of the comparison, their lag bounded by verl's async_training settings
        rlcheck_verl.observe(monitor(), self.global_steps, batch, logp_train=old_log_prob.batch["old_log_probs"],
                             param_version=self.current_param_version,
                             async_training=self.config.async_training)
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
                             metrics, request_ids=[str(k) for k in batch.keys], global_steps=self.global_steps,
                             config=self.config)
        return batch
    return _compute_old_log_prob


def _wrap_init_workers(original):
    @functools.wraps(original)
    def init_workers(self, *args, **kwargs):
        global _preflight, _precision
        _preflight = rlcheck_verl.preflight(self.config)  # before verl starts vLLM: a warning block, critical refused
        _precision = rlcheck_verl.precision(self.config)  # the run's floor: its gates scale with it
        return original(self, *args, **kwargs)
    return init_workers


def install() -> list[str]:
    """Wrap `_compute_old_log_prob` of each verl trainer importable here, and its `init_workers` (where it
    has one) with rlcheck's static preflight first; returns what was wrapped."""
    wrapped = []
    for module, cls, wrap in (("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", _wrap_legacy),
                              ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", _wrap_v1),
                              ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer",
                               _wrap_fully_async)):
        try:
            trainer = getattr(__import__(module, fromlist=[cls]), cls)
        except ImportError:  # this process lacks that trainer's dependencies: it cannot run it either
            continue
        if not getattr(trainer._compute_old_log_prob, "_rlcheck", False):
            trainer._compute_old_log_prob = wrap(trainer._compute_old_log_prob)
            trainer._compute_old_log_prob._rlcheck = True
        if hasattr(trainer, "init_workers") and not getattr(trainer.init_workers, "_rlcheck", False):
            trainer.init_workers = _wrap_init_workers(trainer.init_workers)
            trainer.init_workers._rlcheck = True
        wrapped.append(f"{module}.{cls}")
    return wrapped


if __name__ == "__main__":
    print("wrapped:", install() or "nothing (verl's trainers do not import here)")
