"""Multi-turn batches from the agent frameworks' own trajectory objects (read as they hold them, by field
name: no framework is imported). Each converter takes the framework's per-trajectory objects and the
trainer's logprobs of each trajectory's response (its `old_log_probs` over the same response tokens) and
returns a `StepBatch` with turns (`rlcheck.core.turns`):

| framework  | what it holds (source)                                                   | turns from        |
|------------|--------------------------------------------------------------------------|-------------------|
| OpenRLHF   | the dict `MultiTurnAgentExecutor.execute` returns: `observation_tokens`, | `action_ranges`   |
|            | `action_ranges` [(start, end)] of each model call in them,              | (explicit; each   |
|            | `rollout_log_probs` aligned to them, 0.0 on prompt and feedback          | call's prompt is  |
|            | (openrlhf/utils/agent.py)                                                | the tokens before)|
| slime      | `Sample`: `tokens` (prompt + response), `response_length`, `loss_mask`,  | runs of 1 in      |
|            | `rollout_log_probs` (the response's), `weight_versions` (one per engine  | `loss_mask`       |
|            | call) (slime/utils/types.py)                                             |                   |
| SkyRL      | per turn a `TurnOutput`: `output_ids`, `output_logprobs`, `obs_ids`,     | the turns (a      |
|            | `added_eos` (an EOS the generator appended: loss mask 0, logprob 0.0)    | `TurnOutput` each)|
|            | (skyrl_train/generators/skyrl_gym_generator.py)                          |                   |
| verifiers  | a branch of the v1 message graph, root to leaf: `MessageNode`s with the  | the sampled nodes |
|            | `token_ids` each adds, `mask`, `logprobs`, `sampled` (verifiers/v1/      | (explicit; each   |
|            | graph.py: their concatenation is exactly what the model saw)             | call's prompt too)|

Where the framework keeps each call's prompt (OpenRLHF, SkyRL, verifiers) the batch records it, and the
cross-turn invariants check it; slime's per-call weight versions become per-turn versions when there is
one per turn (a partial rollout's extra calls leave them per trajectory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.turns import TurnRecord
from rlcheck.core.turns_build import Trajectory, Turn
from rlcheck.errors import InputError


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """A field of a framework object: a dict key or an attribute."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _ids(n: int, request_ids: Sequence[str] | None, prefix: str) -> list[str]:
    if request_ids is None:
        return [f"{prefix}-{i}" for i in range(n)]
    if len(request_ids) != n:
        raise InputError(f"request_ids: {len(request_ids)} ids for {n} trajectories")
    return list(request_ids)


def _check(n: int, logp_train: Sequence[Any]) -> None:
    if len(logp_train) != n:
        raise InputError(f"logp_train: {len(logp_train)} arrays for {n} trajectories (one per trajectory's response)")


def from_openrlhf(outputs: Sequence[Any], logp_train: Sequence[Any],
                  request_ids: Sequence[str] | None = None) -> StepBatch:
    """OpenRLHF agent outputs (`MultiTurnAgentExecutor.execute`'s dicts): the response is everything from
    the first action on; `logp_train[i]`: the trainer's logprobs over it."""
    _check(len(outputs), logp_train)
    trajectories = []
    for i, out in enumerate(outputs):
        obs = np.asarray(_get(out, "observation_tokens"), dtype=np.int64)
        ranges = [(int(a), int(b)) for a, b in _get(out, "action_ranges") or ()]
        lps = _get(out, "rollout_log_probs")
        if not ranges or lps is None:
            raise InputError(f"openrlhf output {i}: needs action_ranges and rollout_log_probs "
                             "(sampling with logprobs on)")
        lps = np.asarray(lps, dtype=np.float64)
        turns = [Turn(obs[a:b], lps[a:b], prompt_ids=obs[:a],
                      observation_ids=obs[b:ranges[k + 1][0] if k + 1 < len(ranges) else obs.shape[0]])
                 for k, (a, b) in enumerate(ranges)]
        trajectories.append(Trajectory(turns, logp_train[i], num_turns=len(ranges)))
    return StepBatch.from_turns(trajectories, _ids(len(outputs), request_ids, "openrlhf"))


def from_slime(samples: Sequence[Any], logp_train: Sequence[Any], request_ids: Sequence[str] | None = None,
               version: Any = int) -> StepBatch:
    """slime `Sample`s: the response is the last `response_length` tokens, its turns the runs of 1 in
    `loss_mask`; `weight_versions` (one per engine call, `version` reads each) become per-turn versions when
    they number the turns. `request_ids` default: "slime-<group_index>-<index>"."""
    _check(len(samples), logp_train)
    lr, lt, tokens, masks, records, versions = [], [], [], [], [], []
    for i, s in enumerate(samples):
        n = int(_get(s, "response_length"))
        toks = np.asarray(_get(s, "tokens"), dtype=np.int64)
        lps = _get(s, "rollout_log_probs")
        if lps is None or len(lps) != n:
            raise InputError(f"slime sample {i}: rollout_log_probs has {None if lps is None else len(lps)} entries for "
                             f"its {n} response tokens")
        mask = np.asarray(_get(s, "loss_mask") or [1] * n, dtype=bool)
        lr.append(np.asarray(lps, dtype=np.float64))
        lt.append(np.asarray(logp_train[i], dtype=np.float64))
        tokens.append(toks[toks.shape[0] - n:])
        masks.append(mask)
        runs = int(np.count_nonzero(mask & ~np.concatenate([[False], mask[:-1]])))
        called = [version(v) for v in _get(s, "weight_versions") or ()]
        records.append(TurnRecord(versions=called if called and len(called) == runs else None))
        versions.append(min(called) if called and len(called) != runs else None)
    ids = request_ids or [f"slime-{_get(s, 'group_index')}-{_get(s, 'index', i)}" for i, s in enumerate(samples)]
    return StepBatch.from_ragged(lr, lt, _ids(len(samples), ids, "slime"), tokens, mask=masks, turns="mask_runs",
                                 turn_records=records,
                                 weight_version=None if any(v is None for v in versions) else versions)


def from_skyrl(prompt_ids: Sequence[Any], turn_outputs: Sequence[Sequence[Any]], logp_train: Sequence[Any],
               request_ids: Sequence[str] | None = None, eos_token_id: int | None = None) -> StepBatch:
    """SkyRL token-in/token-out trajectories: each one's prompt ids and its `TurnOutput`s. An EOS the
    generator appended (`added_eos`) is not the model's: it joins the observation (mask 0, logprob 0.0)."""
    _check(len(turn_outputs), logp_train)
    trajectories = []
    for i, (prompt, outs) in enumerate(zip(prompt_ids, turn_outputs, strict=True)):
        context = np.asarray(prompt, dtype=np.int64)
        turns = []
        for k, t in enumerate(outs):
            out = np.asarray(_get(t, "output_ids"), dtype=np.int64)
            lps = _get(t, "output_logprobs")
            if lps is None:
                raise InputError(f"skyrl trajectory {i} turn {k}: no output_logprobs (sampling_params.logprobs)")
            obs = np.asarray(_get(t, "obs_ids") or (), dtype=np.int64)
            added = bool(_get(t, "added_eos", False))
            sampled, lps = (out[:-1], list(lps)[:-1]) if added else (out, list(lps))
            join = out[-1:] if added else np.zeros(0, np.int64)
            turns.append(Turn(sampled, np.asarray(lps, dtype=np.float64), prompt_ids=context,
                              observation_ids=np.concatenate([join, obs])))
            context = np.concatenate([context, out, obs])
        trajectories.append(Trajectory(turns, logp_train[i], num_turns=len(outs)))
    return StepBatch.from_turns(trajectories, _ids(len(turn_outputs), request_ids, "skyrl"))


def from_verifiers(branches: Sequence[Sequence[Any]], logp_train: Sequence[Any],
                   request_ids: Sequence[str] | None = None) -> StepBatch:
    """verifiers v1 message-graph branches (root to leaf `MessageNode`s): each sampled node is a model
    turn (its masked tokens; its leading scaffold, the generation prompt, and every node between are the
    observation); what the model saw at a call is every token before its sampled ones."""
    _check(len(branches), logp_train)
    trajectories = []
    for i, nodes in enumerate(branches):
        ids, sampled_from, lps, turn_of = [], [], [], []
        for k, node in enumerate(nodes):
            toks = list(_get(node, "token_ids") or ())
            mask = list(_get(node, "mask") or [False] * len(toks))
            node_lps = list(_get(node, "logprobs") or [0.0] * len(toks))
            if len(mask) != len(toks) or len(node_lps) != len(toks):
                raise InputError(f"verifiers branch {i} node {k}: token_ids, mask and logprobs differ in length")
            on = bool(_get(node, "sampled", False))
            ids += toks
            sampled_from += [on and m for m in mask]
            lps += node_lps
            turn_of += [k] * len(toks)
        trajectories.append(_graph_trajectory(np.asarray(ids, np.int64), np.asarray(sampled_from, bool),
                                              np.asarray(lps, np.float64), np.asarray(turn_of), logp_train[i], i))
    return StepBatch.from_turns(trajectories, _ids(len(branches), request_ids, "verifiers"))


def _graph_trajectory(ids: np.ndarray, sampled: np.ndarray, lps: np.ndarray, node: np.ndarray, lt: Any,
                      i: int) -> Trajectory:
    """One branch's turns: each run of one node's sampled tokens is a call."""
    if not sampled.any():
        raise InputError(f"verifiers branch {i}: no sampled token (no model turn)")
    same = np.concatenate([[False], sampled[:-1] & (node[1:] == node[:-1])])  # (T,) continues the run before
    start = np.flatnonzero(sampled & ~same)
    stop = np.append(start[1:], ids.shape[0])
    stop = np.array([a + int(np.argmin(np.append(sampled[a:b] & (node[a:b] == node[a]), False)))
                     for a, b in zip(start, stop, strict=True)])
    turns = [Turn(ids[a:b], lps[a:b], prompt_ids=ids[:a],
                  observation_ids=ids[b:start[k + 1] if k + 1 < start.size else ids.shape[0]])
             for k, (a, b) in enumerate(zip(start, stop, strict=True))]
    return Trajectory(turns, lt, num_turns=int(start.size))
