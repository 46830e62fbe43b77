"""verl's agent loops (`verl.experimental.agent_loop`): multi-turn rows and their turns.

verl's `AgentLoopWorker` lays each trajectory out as one row: `responses` holds the model's tokens and the
tool replies together, `response_mask` 1 on the model's and 0 on the replies' (and on the "\\n" its
Continuous Token builder inserts after a sampled <|im_end|>), and no turn boundary is stored. The turns are
the runs of 1 in `response_mask` (`Turns.from_mask`), cross-checked against the trajectory's
`non_tensor_batch["__num_turns__"]`, which counts "user, assistant, tool" turns: `ToolAgentLoop` sets it to
user_turns + assistant_turns + 1, one user turn (a tool reply merged) between each two assistant turns, so
2 x the model's turns; `SingleTurnAgentLoop` sets 2. A custom agent loop that counts otherwise passes its
own `model_turns`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.turns import TurnRecord
from rlcheck.errors import InputError

NUM_TURNS_KEY = "__num_turns__"


def tool_agent_model_turns(num_turns: int) -> int:
    """The model's turns of a verl `ToolAgentLoop` / `SingleTurnAgentLoop` trajectory from its `num_turns`
    (user + assistant + 1, a user turn between each two assistant turns): num_turns // 2."""
    return int(num_turns) // 2


def with_agent_turns(batch: StepBatch, non_tensors: Mapping[str, Any],
                     model_turns: Callable[[int], int] = tool_agent_model_turns) -> StepBatch:
    """`batch` with turns from `response_mask` runs and each row's model-turn count from `__num_turns__`
    (the turn-count invariant compares them), when some row took more than one model turn; as it is else."""
    counts = non_tensors.get(NUM_TURNS_KEY) if hasattr(non_tensors, "get") else None
    if counts is None:
        return batch
    counts = np.asarray(counts).reshape(-1)
    if counts.shape[0] != batch.num_sequences:
        raise InputError(f"non_tensor_batch[{NUM_TURNS_KEY!r}] has {counts.shape[0]} entries for "
                         f"{batch.num_sequences} rows")
    model = [model_turns(int(n)) for n in counts]
    if max(model, default=0) <= 1:
        return batch  # single-turn rows: nothing per turn to watch, no cost
    return batch.with_turns("mask_runs", records=[TurnRecord(num_turns=k) for k in model])
