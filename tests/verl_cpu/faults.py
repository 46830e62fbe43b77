"""Faults injected into verl's real trainer, and a record of what verl's loss received: a verl plugin of
the test support, loaded in every verl process (`VERL_USE_EXTERNAL_MODULES`, before rlcheck's plugin, so
rlcheck sees what the fault did). Both are set by environment variables (`tests.verl_cpu.run`):

    RLCHECK_VERL_FAULTS="skip-sync@2,corrupt-rows=1@3"   NAME[=VALUE]@STEP, comma-separated
    RLCHECK_VERL_RECORD=DIR                               JSONL records written into DIR

| fault | where | what happens |
|---|---|---|
| skip-sync@K | driver | the weight sync after step K is not made: the engine keeps the weights (and the version, K-1) it had, step K+1 generates on them |
| perturb-layer=L@K | vLLM workers | from the sync that gives the engine version K (after step K) on, decoder layer L's attention output projection computes 1.5 x its output, inside the engine only |
| stop-token@K | driver (legacy) | at step K the actor scores every response that ends with EOS without its EOS (attention 0 there: verl's old_log_probs is 0 where the engine has its logprob of EOS; the engine's logprobs of those EOS recorded: the fault's size) |
| corrupt-rows=N@K | driver | at step K, N rows' engine logprobs are 3 nats lower on every token (an engine that computed garbage for a few sequences) |
| tool-in-loss@K | driver (legacy, v1) | at step K every multi-turn row's tool replies (response_mask 0 between the model's turns) get response_mask 1: the tool's tokens counted in verl's loss, as a mask bug of an agent loop does (rllm #497) |

Records (one JSON line each): `batch.jsonl` (driver: each step's weight versions as verl put them in the
batch, and the agent loop's `__num_turns__` per row), `verl_debug.jsonl` (driver: verl's `calculate_debug_metrics` on the step's batch in float64), `loss.jsonl` (actor worker: each call of verl's `ppo_loss`, the
rows it masks out and the importance weights it multiplies by).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rlcheck.integrations.verl.imports import after_import

PERTURB_FACTOR = 1.5
CORRUPT_NATS = 3.0


def faults() -> dict[str, tuple[int, int]]:
    """{name: (value, step)} of RLCHECK_VERL_FAULTS."""
    out = {}
    for spec in filter(None, (s.strip() for s in os.environ.get("RLCHECK_VERL_FAULTS", "").split(","))):
        head, _, step = spec.partition("@")
        name, _, value = head.partition("=")
        out[name] = (int(value or 0), int(step))
    return out


def record(name: str, **fields: Any) -> None:
    root = os.environ.get("RLCHECK_VERL_RECORD")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
        with open(Path(root) / f"{name}.jsonl", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


def active(name: str, step: int) -> int | None:
    """The fault's value when `name` acts at `step`, else None."""
    found = faults().get(name)
    return found[0] if found is not None and found[1] == step else None


# ---- driver: the weight sync, the batch the actor scores -------------------------------------------


def _skip_sync(module: ModuleType) -> None:
    """CheckpointEngineManager.update_weights is verl's `auto_await` coroutine (awaited by the fully async
    trainer, called plainly by the others): the wrapper is one too, around the coroutine it wraps."""
    from verl.utils.ray_utils import auto_await

    manager = module.CheckpointEngineManager
    inner = manager.update_weights.__wrapped__

    @auto_await
    @functools.wraps(inner)
    async def update_weights(self, global_steps=None, *args, **kwargs):
        if global_steps is not None and active("skip-sync", int(global_steps)) is not None:
            record("faults", fault="skip-sync", step=int(global_steps))
            return {}
        return await inner(self, global_steps, *args, **kwargs)

    manager.update_weights = update_weights


def _rows_of(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return data["response_mask"], data["rollout_log_probs"]


def _corrupt(mask: torch.Tensor, rollout: torch.Tensor, num_rows: int) -> list[int]:
    """Lower the engine logprobs of the first `num_rows` rows with a response by CORRUPT_NATS, in place."""
    rows = [int(i) for i in torch.nonzero(mask.sum(-1) > 4).flatten()[:num_rows]]
    for i in rows:
        rollout[i] = torch.where(mask[i].bool(), rollout[i] - CORRUPT_NATS, rollout[i])
    return rows


def _without_stop(batch: Any, eos: int) -> tuple[Any, list[int]]:
    """A copy of the legacy DataProto whose responses ending with `eos` have attention 0 on it."""
    scored = batch.select(deepcopy=True) if hasattr(batch, "select") else batch
    responses, mask = scored.batch["responses"], scored.batch["response_mask"]
    width = responses.shape[1]
    lengths = mask.sum(-1)
    rows = []
    for i in range(responses.shape[0]):
        n = int(lengths[i])
        if n > 1 and int(responses[i, n - 1]) == eos:
            scored.batch["attention_mask"][i, -width + n - 1] = 0
            rows.append(i)
    return scored, rows


def _tool_in_loss(mask: torch.Tensor) -> list[int]:
    """Set `mask` to 1 between each row's first and last 1 (the tool replies between the model's turns), in
    place; the rows changed."""
    rows = []
    for i in range(mask.shape[0]):
        ones = torch.nonzero(mask[i]).flatten()
        if len(ones) and int(ones[-1] - ones[0] + 1) > len(ones):
            mask[i, int(ones[0]): int(ones[-1]) + 1] = 1
            rows.append(i)
    return rows


def _legacy_step(module: ModuleType) -> None:
    trainer = module.RayPPOTrainer
    original = trainer.__dict__["_compute_old_log_prob"]

    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        step = int(self.global_steps)
        nt = batch.non_tensor_batch
        version = getattr(self, "current_param_version", None)  # the fully async trainer's (a subclass)
        record("batch", trainer="legacy" if version is None else "fully_async", step=step, param_version=version,
               min_global_steps=[int(v) for v in nt["min_global_steps"]],
               max_global_steps=[int(v) for v in nt["max_global_steps"]],
               num_rows=len(batch), ends_with_eos=int(_ends_with(batch, self.tokenizer.eos_token_id)),
               num_turns=[int(v) for v in nt["__num_turns__"]] if "__num_turns__" in nt else None,
               model_tokens=batch.batch["response_mask"].sum(-1).tolist())
        if active("tool-in-loss", step) is not None:
            rows = _tool_in_loss(batch.batch["response_mask"])
            record("faults", fault="tool-in-loss", step=step, rows=rows, uids=[str(nt["uid"][i]) for i in rows])
        n = active("corrupt-rows", step)
        if n is not None:
            rows = _corrupt(*_rows_of(batch.batch), n)
            record("faults", fault="corrupt-rows", step=step, rows=rows, uids=[str(nt["uid"][i]) for i in rows])
        scored = batch
        if active("stop-token", step) is not None:
            scored, rows = _without_stop(batch, self.tokenizer.eos_token_id)
            lengths = batch.batch["response_mask"].sum(-1)
            eos = [float(batch.batch["rollout_log_probs"][i, int(lengths[i]) - 1]) for i in rows]
            record("faults", fault="stop-token", step=step, rows=rows, eos_logprobs=eos)  # the fault's size: |each|
        out = original(self, scored, *args, **kwargs)
        fields = {k: batch.batch[k] for k in ("rollout_log_probs", "response_mask", "responses")}
        _record_debug_metrics(step, {**fields, "old_log_probs": out[0].batch["old_log_probs"]})
        return out

    trainer._compute_old_log_prob = _compute_old_log_prob


def _record_debug_metrics(step: int, fields: Any) -> None:
    """verl's own `calculate_debug_metrics` on the step's batch, the logprobs in float64 (what rlcheck's
    figures are checked against; verl's logged ones take exp() in the logprobs' own dtype)."""
    from tensordict import TensorDict
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    keys = ("old_log_probs", "rollout_log_probs", "response_mask", "responses")
    exact = {k: fields[k].double() if k.endswith("log_probs") else fields[k] for k in keys}
    found = calculate_debug_metrics(DataProto(batch=TensorDict(exact, batch_size=exact["responses"].shape[0])))
    record("verl_debug", step=step, **{k: float(v) for k, v in found.items()},
           dtype=str(fields["old_log_probs"].dtype))


def _ends_with(batch: Any, eos: int) -> int:
    lengths = batch.batch["response_mask"].sum(-1)
    return sum(int(n) > 0 and int(batch.batch["responses"][i, int(n) - 1]) == eos for i, n in enumerate(lengths))


def _v1_step(module: ModuleType) -> None:
    trainer = module.PPOTrainer
    original = trainer.__dict__["_compute_old_log_prob"]

    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, metrics, *args, **kwargs):
        step = int(self.global_steps)
        tags = list(batch.tags)
        record("batch", trainer="v1", step=step, min_global_steps=sorted({int(t["min_global_steps"]) for t in tags}),
               max_global_steps=sorted({int(t["max_global_steps"]) for t in tags}), num_rows=len(tags),
               num_turns=_num_turns_v1(batch))
        n = active("corrupt-rows", step)
        if n is not None:
            _corrupt_v1(batch, n, step)
        if active("tool-in-loss", step) is not None:
            _tool_in_loss_v1(batch, step)
        out = original(self, batch, metrics, *args, **kwargs)
        import transfer_queue as tq

        fields = ["old_log_probs", "rollout_log_probs", "response_mask", "responses"]
        _record_debug_metrics(step, tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id,
                                                    select_fields=fields).to_padded_tensor())
        return out

    trainer._compute_old_log_prob = _compute_old_log_prob


def _corrupt_v1(batch: Any, num_rows: int, step: int) -> None:
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    keys = list(batch.keys)
    stored = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["response_mask", "rollout_log_probs"])
    padded = stored.to_padded_tensor()
    rows = _corrupt(padded["response_mask"], padded["rollout_log_probs"], num_rows)
    fields = {"rollout_log_probs": response_to_nested(padded["rollout_log_probs"], stored["response_mask"])}
    tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=TensorDict(fields, batch_size=len(keys)))
    record("faults", fault="corrupt-rows", step=step, rows=rows, keys=[keys[i] for i in rows])


def _num_turns_v1(batch: Any) -> list[int]:
    import transfer_queue as tq

    stored = tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id, select_fields=["num_turns"])
    return [int(n) for n in stored.pop("num_turns").tolist()]


def _tool_in_loss_v1(batch: Any, step: int) -> None:
    """`_tool_in_loss` on the v1 rows in the TransferQueue: their response_mask and the loss_mask copy of it."""
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    keys = list(batch.keys)
    stored = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    mask = stored.to_padded_tensor()["response_mask"]
    rows = _tool_in_loss(mask)
    nested = response_to_nested(mask, stored["response_mask"])
    tq.kv_batch_put(keys=keys, partition_id=batch.partition_id,
                    fields=TensorDict({"response_mask": nested, "loss_mask": nested}, batch_size=len(keys)))
    record("faults", fault="tool-in-loss", step=step, rows=rows, keys=[keys[i] for i in rows])


# ---- the engine: one layer off -------------------------------------------------------------------


def _perturb_method(module: ModuleType) -> None:
    """vLLM's workers get a method the actor's side calls by name (verl's `collective_rpc`)."""

    def rlcheck_perturb_layer(self, layer: int, factor: float) -> str:
        from rlcheck.engines.vllm_perturb import _scale_output

        target = _scale_output(self.model_runner.model, layer, factor)
        record("faults", fault="perturb-layer", target=target)
        return target

    module.vLLMColocateWorkerExtension.rlcheck_perturb_layer = rlcheck_perturb_layer


def _perturb_after_sync(module: ModuleType) -> None:
    """In the actor's process: right after the sync that gives the engine version K, layer L is perturbed."""
    adapter = module.ServerAdapter
    original = adapter.update_weights

    @functools.wraps(original)
    async def update_weights(self, weights, global_steps=None, *args, **kwargs):
        out = await original(self, weights, global_steps, *args, **kwargs)
        layer = None if global_steps is None else active("perturb-layer", int(global_steps))
        if layer is not None:
            await self._execute_method("rlcheck_perturb_layer", kwargs={"layer": layer, "factor": PERTURB_FACTOR})
            record("faults", fault="perturb-sync", step=int(global_steps))
        return out

    adapter.update_weights = update_weights


# ---- the actor worker: what verl's loss gets ---------------------------------------------------------


def _number(data: Any, key: str) -> float | None:
    try:
        return float(data[key])
    except (KeyError, TypeError, ValueError):
        return None


def _loss(module: ModuleType) -> None:
    original = module.ppo_loss

    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        fields = data.select(*[k for k in ("response_mask", "rollout_is_weights") if k in data]).to_padded_tensor()
        mask = fields["response_mask"].bool()  # (B, R)
        weights = fields.get("rollout_is_weights", None)
        record("loss", rows=int(mask.shape[0]), masked_rows=int((mask.sum(-1) == 0).sum()),
               mask_tokens=int(mask.sum()), row_tokens=mask.sum(-1).tolist(),
               weights_sum=None if weights is None else float(weights[mask].double().sum()),
               weights_min=None if weights is None else float(weights[mask].min()),
               batch_num_tokens=_number(data, "batch_num_tokens"))
        return original(config, model_output, data, dp_group)

    module.ppo_loss = ppo_loss


after_import("verl.checkpoint_engine.base", _skip_sync)
after_import("verl.trainer.ppo.ray_trainer", _legacy_step)
after_import("verl.trainer.ppo.v1.trainer_base", _v1_step)
after_import("verl.workers.rollout.vllm_rollout.utils", _perturb_method)
after_import("verl.workers.rollout.vllm_rollout.vllm_rollout", _perturb_after_sync)
after_import("verl.workers.utils.losses", _loss)
