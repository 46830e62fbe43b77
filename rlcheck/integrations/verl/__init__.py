"""verl: feed rlcheck's Monitor from verl's step batch, the `DataProto` the driver holds.

verl (0.9) keeps one padded batch per step on the driver process (the single controller; workers send
their results back to it), B = prompts x rollout.n rows:

    responses           (B, R) int64    sampled token ids, right-padded
    response_mask       (B, R) int64    1: a generated token that trains; 0: padding, tool output
    rollout_log_probs   (B, R) float32  vLLM's logprob of each sampled token, 0.0 on padding; only
                                        with actor_rollout_ref.rollout.calculate_log_probs=True
    old_log_probs       (B, R) float32  the actor's recomputation under the same weights
    prompts             (B, P) int64    left-padded prompt ids; attention_mask (B, P+R) marks real tokens
    non_tensor_batch    "uid": one uuid per prompt, repeated for its n samples; "request_id" only
                        when a custom agent loop puts it in extra_fields; "min_global_steps" /
                        "max_global_steps" (fully async and the v1 trainer): the first and last
                        weights version a trajectory was generated with

    batch = to_step_batch(data)                         # a StepBatch, one sequence per row
    report = observe(monitor, step, data, metrics)      # Monitor.observe, plus verl's own metrics

Request ids: `non_tensor_batch["request_id"]` when every row has one, else "<uid>/<k>" with k the row's
rank among the rows of its uid in batch order (verl's `_balance_batch` may have reordered the rows).
The dump also gets the per-row `uid`, `priority` (the row's place in the rollout batch; the vLLM request
id is "det-<priority>" under rollout.full_determinism) and `data_source` when verl has them.

Weight versions: where the batch has `min_global_steps`, each sequence's `weight_version` is that (the
oldest weights that generated any of its tokens). Legacy `RayPPOTrainer` and v1: pass verl's own
`observe(..., global_steps=self.global_steps)`; step G runs on the weights synced at the end of step
G-1 (`rollout_version`), and rows older than that by more than `MonitorConfig.max_weight_lag` (0,
on-policy) raise the critical `weights` alarm. The fully async trainer (partial rollouts or not):
`observe(..., param_version=self.current_param_version, async_training=config.async_training)`: the
rows generated entirely on that version are compared, the lagged ones (off-policy by design) are left
out and counted, and a row further behind than verl's settings allow is the `weights` alarm
(`rlcheck.integrations.verl.fully_async`: the bound is ceil(staleness_threshold) + partial_rollout;
`staleness_threshold` is a fraction of samples, not itself a lag).

Where to call it: with the legacy `RayPPOTrainer`, once per step in `_compute_old_log_prob`, before the
rollout correction rewrites `response_mask` and before the actor update. verl's own trainers need no
call: rlcheck's verl plugin (`rlcheck.integrations.verl.plugin`) makes it there.

Agent loops (multi-turn rows, `non_tensor_batch["__num_turns__"]` of more than one model turn): the turns
are the runs of 1 in `response_mask`, checked against verl's own count (`rlcheck.integrations.verl.turns`);
the per-turn statistics (`rlcheck/turn/*`) and the cross-turn invariants follow (docs/multiturn.md).

Before the run: `preflight(config)` (verl's config) runs rlcheck's static preflight before verl starts vLLM
(the plugin does it before the trainer starts its workers); its findings go into the Monitor's context.

Handing the verdict back: `observe` then updates `data` in place, as verl's own
`compute_rollout_correction_and_add_to_batch` does (`update_batch`; row b is sequence b of the report):

    report = observe(mon, step, data, correction=CorrectionConfig(rollout_is="token"))
    data.batch["response_mask"]       # 0 on the rows `report.keep` drops (MonitorConfig.quarantine)
                                      # and on the tokens `correction.rollout_rs` rejects
    data.batch["rollout_is_weights"]  # (B, R), old_log_probs' dtype and device: verl's actor scales
                                      # the policy loss by it (only with correction.rollout_is set)

`correction=monitor.cfg.correction` hands back the correction whose metrics the Monitor logs
(`rlcheck/corr/...`). The hand-back covers every row verl trains on: with the fully async trainer the
lagged rows, left out of the statistics, keep their `response_mask` and get the correction's weights
as verl's own correction would give them (the metrics are those of the compared rows). Without quarantine and correction nothing is written; where `observe` halts,
nothing either. Give `correction` only with verl's own `algorithm.rollout_correction.rollout_is`
unset: verl refuses to union a second `rollout_is_weights` (its rejection may stay on: it then runs
on the mask rlcheck handed back).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch, to_numpy
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.types import StepReport
from rlcheck.errors import ConfigError, InputError
from rlcheck.integrations.verl.fields import (  # noqa: F401 - the keys are this module's API too
    MASK_KEY,
    RESPONSES_KEY,
    ROLLOUT_KEY,
    TRAIN_KEY,
    WEIGHTS_KEY,
    fields_of,
    get_field,
    logprobs_of,
    response_mask_of,
)
from rlcheck.integrations.verl.fully_async import fully_async_max_lag, on_version
from rlcheck.integrations.verl.handback import update_batch
from rlcheck.integrations.verl.settings import refuse_bypass
from rlcheck.integrations.verl.turns import with_agent_turns
from rlcheck.versions import check_tested

META_KEYS = ("uid", "priority", "data_source")
"""Per-row `non_tensor_batch` columns copied into the dump when present."""
VERSION_KEY = "min_global_steps"
"""Per-row weights version verl's fully async trainer and v1 agent loop record (the first of a trajectory)."""
FORWARD_PREFIXES = ("training/rollout_", "rollout_corr/", "actor/entropy")
"""verl step metrics `observe` logs beside rlcheck's by default: its own mismatch view and entropy."""

VERL_EQUIVALENTS: dict[str, tuple[str, float]] = {
    "training/rollout_probs_diff_mean": (K.PROB_ABS_DIFF_MEAN, 1.0),
    "training/rollout_probs_diff_max": (K.PROB_ABS_DIFF_MAX, 1.0),
    "rollout_corr/kl": (K.KL_K1, 1.0),
    "rollout_corr/k3_kl": (K.KL_K3, 1.0),
    "rollout_corr/chi2_token": (K.CHI2, 1.0),
    "rollout_corr/log_ppl_diff": (K.SEQ_LOG_PPL_DIFF_MEAN, -1.0),
}
"""verl metric -> (rlcheck key, sign): verl's value is sign x rlcheck's on the same batch and mask (verl's
`calculate_debug_metrics` and `compute_offpolicy_metrics`), while no |d| exceeds 20 (verl clips the
log-ratio there for chi2) and no row is fully masked (verl averages those in as 0 for log_ppl_diff)."""


def _check_shapes(arrays: Mapping[str, np.ndarray]) -> tuple[int, int]:
    shape = arrays[ROLLOUT_KEY].shape
    if len(shape) != 2:
        raise InputError(f"{ROLLOUT_KEY} has shape {shape}: expected [batch, response_length]")
    for name, a in arrays.items():
        if a is not None and a.shape != shape:
            raise InputError(
                f"{name} has shape {a.shape}, {ROLLOUT_KEY} has {shape}: verl's response fields are all "
                "[batch, response_length]; pass them from one batch"
            )
    return shape


def default_request_ids(non_tensors: Mapping[str, Any], num_rows: int) -> list[str]:
    """Each row's request id: the `request_id` column when complete, else "<uid>/<k>" (module docstring)."""
    rid = get_field(non_tensors, "request_id")
    if rid is not None and len(rid) == num_rows and all(r is not None and str(r) for r in rid):
        return [str(r) for r in rid]
    uids = get_field(non_tensors, "uid")
    if uids is None:
        raise InputError(
            "no 'uid' or 'request_id' in non_tensor_batch to name the rows; pass request_ids="
        )
    if len(uids) != num_rows:
        raise InputError(f"non_tensor_batch['uid'] has {len(uids)} entries for {num_rows} rows")
    seen: dict[str, int] = {}
    out = []
    for uid in uids:
        uid = str(uid)
        k = seen.get(uid, 0)
        seen[uid] = k + 1
        out.append(f"{uid}/{k}")
    return out


def _prompt_tokens(tensors: Any, num_rows: int, num_cols: int) -> list[np.ndarray] | None:
    """Each row's prompt ids without verl's left padding, when `prompts` and `attention_mask` are there."""
    prompts, attn = get_field(tensors, "prompts"), get_field(tensors, "attention_mask")
    if prompts is None or attn is None:
        return None
    p = to_numpy(prompts, "prompts")  # (B, P)
    a = to_numpy(attn, "attention_mask")  # (B, P + R)
    if p.ndim != 2 or p.shape[0] != num_rows or a.shape != (num_rows, p.shape[1] + num_cols):
        return None
    keep = a[:, : p.shape[1]].astype(bool)  # (B, P)
    flat = p[keep].astype(np.int64)
    return np.split(flat, np.cumsum(keep.sum(axis=1))[:-1])


def _meta(non_tensors: Mapping[str, Any], num_rows: int) -> dict[str, list[Any]]:
    out = {}
    for key in META_KEYS:
        col = get_field(non_tensors, key)
        if col is not None and len(col) == num_rows:
            out[key] = np.asarray(col).tolist()
    return out


def to_step_batch(data: Any, *, logp_train: Any = None, request_ids: Sequence[str] | None = None) -> StepBatch:
    """A `StepBatch` of verl's batch: rollout vs `old_log_probs` on `response_mask`, one sequence per row.

    `data`: a `verl.DataProto`, or a mapping of the same fields (tensors and per-row arrays together).
    `logp_train`: (B, R) logprobs to compare against instead of `old_log_probs`.
    `request_ids`: B ids instead of the default ones (`default_request_ids`)."""
    tensors, non_tensors = fields_of(data)
    rollout, train = logprobs_of(tensors, logp_train)
    lr = to_numpy(rollout, ROLLOUT_KEY)
    num_cols = lr.shape[-1] if lr.ndim else 0
    responses = get_field(tensors, RESPONSES_KEY)
    arrays = {
        ROLLOUT_KEY: lr,
        TRAIN_KEY: to_numpy(train, TRAIN_KEY),
        MASK_KEY: to_numpy(response_mask_of(tensors, num_cols), MASK_KEY),
        RESPONSES_KEY: None if responses is None else to_numpy(responses, RESPONSES_KEY),
    }
    num_rows, num_cols = _check_shapes(arrays)
    ids = default_request_ids(non_tensors, num_rows) if request_ids is None else request_ids
    batch = StepBatch.from_padded(
        arrays[ROLLOUT_KEY],
        arrays[TRAIN_KEY],
        arrays[MASK_KEY],
        ids,
        tokens=arrays[RESPONSES_KEY],
        prompt_tokens=_prompt_tokens(tensors, num_rows, num_cols),
        weight_version=_versions(non_tensors, num_rows),
        meta=_meta(non_tensors, num_rows),
    )
    return with_agent_turns(batch, non_tensors)  # an agent loop's multi-turn rows (`verl.turns`)


def _versions(non_tensors: Mapping[str, Any], num_rows: int) -> list[int] | None:
    """Each row's `min_global_steps` as a weights version, when verl recorded one for every row."""
    if VERSION_KEY not in non_tensors:
        return None
    values = list(np.asarray(non_tensors[VERSION_KEY], dtype=object).reshape(-1))
    if len(values) != num_rows:
        raise InputError(f"non_tensor_batch[{VERSION_KEY!r}] has {len(values)} entries for {num_rows} rows")
    if any(v is None for v in values):
        return None  # an agent loop that does not track versions
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise InputError(f"non_tensor_batch[{VERSION_KEY!r}] must hold integer weight versions, got {values[:3]}") from None


def rollout_version(global_steps: int | None, trainer_version: int | None) -> int | None:
    """The weights version step `global_steps`'s rows should carry in `min_global_steps`: the legacy
    `RayPPOTrainer` and the v1 trainer sync with `update_weights(G)` at the end of step G (and
    `update_weights(0)` before step 1), so step G generates on version G-1 (v1's own
    `trajectory_staleness_worst = (global_steps - 1) - min_global_steps`)."""
    if global_steps is None:
        return trainer_version
    if trainer_version is not None:
        raise ConfigError("observe: pass verl's global_steps or trainer_version, not both (global_steps "
                          "is mapped to the rollout's weights version, global_steps - 1)")
    if isinstance(global_steps, bool) or not isinstance(global_steps, (int, np.integer)) or global_steps < 1:
        raise ConfigError(f"global_steps must be verl's step counter (an integer >= 1), got {global_steps!r}")
    return int(global_steps) - 1


def forwarded_metrics(metrics: Mapping[str, Any] | None,
                      prefixes: Iterable[str] | None = FORWARD_PREFIXES) -> dict[str, float]:
    """The finite numeric entries of verl's step `metrics` whose key starts with one of `prefixes`
    (all of them when None), ready for `Monitor.observe(extra=...)`."""
    starts = None if prefixes is None else tuple(prefixes)
    out = {}
    for key, value in (metrics or {}).items():
        if not isinstance(key, str) or key.startswith(K.PREFIX) or (starts is not None and not key.startswith(starts)):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # lists, strings, tensors of many elements
            continue
        if np.isfinite(number):
            out[key] = number
    return out


def preflight(config: Any) -> tuple:
    """The static preflight of verl's trainer config (`actor_rollout_ref`), before verl starts its workers
    and vLLM (`rlcheck.integrations.verl.preflight_checks`): the findings print as one warning block, critical
    ones raise `ConfigError`; put them in the Monitor's context (`rlcheck.preflight.as_context`)."""
    from rlcheck.integrations.verl.preflight_checks import verl_preflight

    return verl_preflight(config)


def precision(config: Any) -> Any:
    """The two sides' dtypes in verl's trainer config, for `MonitorConfig(precision=...)`: the run's
    floor, which the detectors' gates are relative to (`rlcheck.core.floors`)."""
    from rlcheck.integrations.verl.preflight_checks import verl_precision

    return verl_precision(config)


def observe(monitor: Any, step: int, data: Any, metrics: Mapping[str, Any] | None = None, *,
            logp_train: Any = None, request_ids: Sequence[str] | None = None,
            forward: Iterable[str] | None = FORWARD_PREFIXES, trainer_version: int | None = None,
            global_steps: int | None = None, correction: CorrectionConfig | None = None,
            param_version: int | None = None, async_training: Any = None, config: Any = None) -> StepReport:
    """`monitor.observe(step, to_step_batch(data))` with verl's step `metrics` (those under `forward`)
    logged beside rlcheck's; `trainer_version`: the weights version the actor holds, compared with the
    rows' `min_global_steps` where verl recorded them; `global_steps` (legacy, v1): verl's own step
    counter instead, mapped to the rollout's version by `rollout_version`; `param_version` with
    `async_training` (the fully async trainer): its `current_param_version` and its `async_training`
    settings, the rows on other versions left out of the comparison and their lag bounded
    (`rlcheck.integrations.verl.fully_async`). Then `update_batch(data, report, correction)`:
    quarantined rows and rejected tokens leave `response_mask`, `rollout_is_weights` is set with
    `correction.rollout_is` (module docstring). `config`: verl's trainer config, whose bypass mode is
    refused (`ConfigError`: its old_log_probs are the rollout's own, a copy in another buffer through v1's
    transfer queue, which bitwise-equal sides alone cannot tell from a true on-policy engine). Returns the
    `StepReport`, raises `MismatchHalt` when the policy halts (`data` untouched)."""
    if config is not None:
        refuse_bypass(config)
    if correction is not None and not isinstance(correction, CorrectionConfig):
        raise ConfigError(f"correction must be a CorrectionConfig or None, got {type(correction).__name__}")
    check_tested("verl", what="the verl adapter (it reads DataProto's fields)")
    trainer_version = rollout_version(global_steps, trainer_version)
    batch = to_step_batch(data, logp_train=logp_train, request_ids=request_ids)
    extra, alarms = forwarded_metrics(metrics, forward), []
    if param_version is not None:
        if trainer_version is not None or async_training is None:
            raise ConfigError("observe: the fully async trainer passes param_version=current_param_version with "
                              "async_training=config.async_training, and neither trainer_version nor global_steps")
        batch, lag_metrics, alarms = on_version(batch, fields_of(data)[1], step, int(param_version),
                                                fully_async_max_lag(async_training))
        extra.update(lag_metrics)
    elif batch.weight_version is None:
        trainer_version = None  # nothing to compare it with
    report = monitor.observe(step, batch, extra=extra, trainer_version=trainer_version, alarms=alarms)
    update_batch(data, report, correction, logp_train=logp_train)
    return report
