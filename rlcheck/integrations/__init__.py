"""Adapters that feed the Monitor from the RL frameworks people already run.

`rlcheck.integrations.trl`: a drop-in for `trl.GRPOTrainer`. `rlcheck.integrations.verl`: verl's batch
fields (`rollout_log_probs`, `old_log_probs`, `response_mask`, request ids) to a `StepBatch`. Each module
imports its framework only when used.
"""
