"""Multi-turn batches built from what an agent loop holds: one `Trajectory` of `Turn`s per sequence
(`StepBatch.from_turns`), or a turn layout given beside the packed tokens (`turns=` of the
constructors, `StepBatch.with_turns`).

    batch = StepBatch.from_turns(
        [Trajectory(turns=[Turn(out0, lp0, prompt_ids=p0, observation_ids=tool0, version=7),
                           Turn(out1, lp1, prompt_ids=p1, version=7)],
                    logp_train=trainer_lp)],          # over out0 + tool0 + out1, the trained response
        request_ids=["traj-0"])

The trained response of a trajectory is laid out turn by turn: the sampled ids of turn k (less a
trailing id the declared `JoinEdits.remove_trailing` drops), then its `observation_ids` (the tool's
reply, the chat template's tokens, any join id the framework inserted): everything between this
turn's output and the next one's. The engine's logprobs go on the sampled tokens; the observation
tokens are tool tokens, masked out, with logprob 0.0 (as TRL and verl hold them). A turn whose
logprob list is shorter than its output keeps the count in its `TurnRecord` (the invariant alarms)
and its tokens without a logprob are masked out, never compared against a made-up value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core.batch_build import bool_array, float_array, int_array
from rlcheck.core.turns import JoinEdits, TurnRecord, Turns
from rlcheck.errors import InputError

TURN_SPECS = ("mask_runs",)


@dataclass(frozen=True)
class Turn:
    """One model call: what the engine sampled, its logprobs, and what followed it."""

    output_ids: Any
    """The ids the engine sampled at this call."""
    logprobs: Any
    """The engine's logprob of each sampled id (one per id; a shorter list alarms)."""
    prompt_ids: Any = None
    """The ids the engine prefilled for this call: the whole context (for the cross-turn invariant)."""
    observation_ids: Any = ()
    """The ids after this turn's output in the trained sequence, up to the next turn's output (the
    tool's reply, template tokens, join ids): tool tokens, masked out."""
    version: int | None = None
    """The weights version that served this call."""


@dataclass(frozen=True)
class Trajectory:
    """One sequence of a multi-turn step: its turns and the trainer's side of it."""

    turns: Sequence[Turn]
    logp_train: Any
    """The trainer's logprobs over the trained response (every turn's output and observation)."""
    tokens_train: Any = None
    """The ids the trainer scored there, when it says (compared with the engine's)."""
    prompt_ids: Any = None
    """The engine's first prompt (default: the first turn's `prompt_ids`)."""
    mask: Any = None
    """The framework's loss mask over the response, when it keeps its own (default: sampled tokens 1,
    observation tokens 0)."""
    num_turns: int | None = None
    """The framework's own count of model turns (cross-checked)."""


def _turn_layout(k: int, turn: Turn, join: JoinEdits | None) -> dict[str, np.ndarray]:
    out = int_array(turn.output_ids, f"turns[{k}].output_ids").reshape(-1)
    lp = float_array(turn.logprobs, f"turns[{k}].logprobs").reshape(-1) if len(turn.logprobs) else np.zeros(0)
    obs = int_array(turn.observation_ids, f"turns[{k}].observation_ids").reshape(-1)
    kept = out.shape[0] - 1 if join is not None and out.size and int(out[-1]) in join.remove_trailing else out.shape[0]
    have = min(lp.shape[0], kept)
    lp_kept = np.concatenate([lp[:have].astype(np.float64), np.zeros(kept - have)])
    return {"ids": np.concatenate([out[:kept], obs]), "lp": np.concatenate([lp_kept, np.zeros(obs.shape[0])]),
            "mask": np.concatenate([np.arange(kept) < have, np.zeros(obs.shape[0], bool)]),
            "index": np.concatenate([np.full(kept, k, np.int64), np.full(obs.shape[0], -1, np.int64)]),
            "count": np.int64(lp.shape[0])}


def _record(traj: Trajectory, counts: list[int]) -> TurnRecord:
    turns = traj.turns
    prompts = [t.prompt_ids for t in turns]
    versions = [t.version for t in turns]
    return TurnRecord(
        prompt_ids=prompts if all(p is not None for p in prompts) else None,
        output_ids=[t.output_ids for t in turns],
        logprob_counts=counts,
        versions=versions if all(v is not None for v in versions) else None,
        num_turns=traj.num_turns,
    )


def trajectories_ragged(trajectories: Sequence[Trajectory], join: JoinEdits | None) -> dict[str, Any]:
    """The keyword arguments of `StepBatch.from_ragged` (and `turns`, a (M,) turn index list per
    sequence with -1 on tool tokens; `records`) for `from_turns`."""
    if not trajectories:
        raise InputError("from_turns: no trajectories (an empty batch has no sequences to compare)")
    out: dict[str, list[Any]] = {k: [] for k in ("logp_rollout", "logp_train", "tokens", "mask", "tokens_train",
                                                 "prompt_tokens", "index", "records")}
    for i, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory) or not traj.turns:
            raise InputError(f"from_turns: trajectory {i} must be a Trajectory with at least one Turn")
        parts = [_turn_layout(k, t, join) for k, t in enumerate(traj.turns)]
        ids = np.concatenate([p["ids"] for p in parts])
        lt = float_array(traj.logp_train, f"trajectories[{i}].logp_train").reshape(-1)
        if lt.shape[0] != ids.shape[0]:
            raise InputError(f"trajectory {i}: logp_train has {lt.shape[0]} entries for the {ids.shape[0]} tokens of its "
                             "response laid out turn by turn (each turn's output, then its observation_ids)")
        mask = np.concatenate([p["mask"] for p in parts])
        if traj.mask is not None:
            mask = bool_array(traj.mask, f"trajectories[{i}].mask").reshape(-1)
        for name, value in (("mask", mask), ("tokens_train", traj.tokens_train)):
            if value is not None and len(value) != ids.shape[0]:
                raise InputError(f"trajectory {i}: {name} has {len(value)} entries for {ids.shape[0]} response tokens")
        prompt = traj.prompt_ids if traj.prompt_ids is not None else traj.turns[0].prompt_ids
        out["logp_rollout"].append(np.concatenate([p["lp"] for p in parts]).astype(lt.dtype if lt.size else np.float64))
        out["logp_train"].append(lt)
        out["tokens"].append(ids)
        out["mask"].append(mask)
        out["tokens_train"].append(traj.tokens_train)
        out["prompt_tokens"].append(prompt)
        out["index"].append(np.concatenate([p["index"] for p in parts]))
        out["records"].append(_record(traj, [int(p["count"]) for p in parts]))
    for name in ("tokens_train", "prompt_tokens"):
        if any(v is None for v in out[name]):
            out[name] = None
    return out


def resolve(spec: Any, cu: np.ndarray, mask: np.ndarray | None, records: Sequence[TurnRecord | None] | None,
            join: JoinEdits | None) -> Turns | None:
    """The `Turns` a constructor's `turns=` names: None, a `Turns` (as is), "mask_runs" (the runs of
    1 in `mask`, every token counted without one), or a per-token turn index (M,) with negatives on
    tool / observation tokens."""
    if spec is None:
        if records is not None or join is not None:
            raise InputError("turn_records / join need turns=: pass turns='mask_runs' or a turn index")
        return None
    if isinstance(spec, Turns):
        if records is not None or join is not None:
            raise InputError("turns= is a Turns: give it its records and join when building it")
        return spec
    if isinstance(spec, str):
        if spec not in TURN_SPECS:
            raise InputError(f"turns={spec!r}: expected one of {TURN_SPECS}, a Turns or a per-token turn index")
        m = np.ones(int(cu[-1]), dtype=bool) if mask is None else mask
        return Turns.from_mask(m, cu, records=records, join=join)
    return Turns.from_index(int_array(spec, "turns"), cu, records=records, join=join)


def ragged_index(spec: Any, num_sequences: int) -> Any:
    """A ragged turn index (one array per sequence) concatenated; anything else as it is."""
    if isinstance(spec, (str, Turns)) or spec is None or isinstance(spec, np.ndarray) or hasattr(spec, "detach"):
        return spec
    if len(spec) != num_sequences:
        raise InputError(f"turns has {len(spec)} sequences, the batch {num_sequences}")
    parts = [int_array(p, f"turns[{i}]").reshape(-1) for i, p in enumerate(spec)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)

