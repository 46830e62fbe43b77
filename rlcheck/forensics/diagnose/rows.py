"""Per-sequence evidence from a dump's rows, for diagnose's token and position rules: each row's mean
|d|, how its two sides' token ids differ, its prompt's padding in a left-padded batch, its tokens'
positions, the prompt prefix it shares with other prompts. Pure numpy over the rows `read_dump` gives.

    rows = ev.dump_rows[step]
    row_abs(rows)               # (N,) mean |d| over each row's compared tokens
    token_pattern(row)          # None (same ids), "last", "shift" (late or early) or "from" (see the function)
    values_fit_shift(row)       # a "shift" row's logprobs read one token over (True) or another sequence (False)
    left_padding(rows)          # (N,) the step's longest prompt minus each row's prompt length
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcheck.core.detect.signature import SignatureConfig
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN

CLEAN = 1e-4
"""Mean |d| of a row that is clean for these rules: 100x the fp32 agreement of the two sides (~1e-6),
below a bf16 engine's floor (~1e-2); a row or group past `CONTRAST` x the clean ones' and past this
is off."""
CONTRAST = 5.0
"""How many times the off group's mean |d| must exceed the clean group's."""
SHIFT_FIT = 0.8
"""Share of the positions after the first difference where trainer[t] == engine[t + 1] (or engine[t - 1]):
a shift by one."""
SHIFT_START = 1
"""The last position a shift's first difference may sit at: 0 for a read one token late; an early read's
first token is the prompt's last (or, repeated, the same id), so it may part at the second."""


def dumped_rows(ev: Any) -> list[tuple[int, list[dict[str, Any]]]]:
    """(step, rows) of every dump of the evidence (`Evidence.dump_rows`), in step order."""
    return sorted(ev.dump_rows.items())


def abs_diff(row: dict[str, Any]) -> np.ndarray:
    """(L,) |d| of the row's compared tokens (masked-out and non-finite ones 0)."""
    lr, lt = np.asarray(row["logp_rollout"], np.float64), np.asarray(row["logp_train"], np.float64)
    keep = np.isfinite(lr) & np.isfinite(lt)
    if row.get("mask") is not None:
        keep &= np.asarray(row["mask"], dtype=bool)
    return np.where(keep, np.abs(np.where(keep, lt - lr, 0.0)), 0.0)


def row_abs(rows: list[dict[str, Any]]) -> np.ndarray:
    """(N,) mean |d| of each row (0 for an empty one)."""
    return np.array([float(a.mean()) if a.size else 0.0 for a in map(abs_diff, rows)])


def ids(row: dict[str, Any], key: str) -> np.ndarray | None:
    value = row.get(key)
    return None if value is None else np.asarray(value, dtype=np.int64)


def token_pattern(row: dict[str, Any]) -> str | None:
    """How the trainer's ids (`tokens_train`) differ from the engine's (`response_tokens`): None when they
    agree (or either is missing); "last": only at the last token; "shift": from the start (`SHIFT_START`)
    on, the trainer holds the engine's next token or its previous one (`shift_direction`); "from": they
    part at a later token (another tokenization of the same text: a merge moves the rest up)."""
    engine, trainer = ids(row, "response_tokens"), ids(row, "tokens_train")
    if engine is None or trainer is None or engine.shape != trainer.shape:
        return None
    diff = np.flatnonzero(engine != trainer)
    if diff.size == 0:
        return None
    if diff.size == 1 and diff[0] == engine.size - 1:
        return "last"
    return "shift" if shift_direction(engine, trainer, int(diff[0])) is not None else "from"


def shift_direction(engine: np.ndarray, trainer: np.ndarray, first: int) -> str | None:
    """"late" when from `first` (the first differing position, at most `SHIFT_START`) on the trainer
    holds the engine's next token (trainer[t] == engine[t + 1] on `SHIFT_FIT` of the positions), "early"
    when it holds the previous one (trainer[t] == engine[t - 1]: a prompt length counted one short),
    else None."""
    if first > SHIFT_START:
        return None
    late = trainer[first:-1] == engine[first + 1:]
    start = max(first, 1)
    early = trainer[start:] == engine[start - 1:-1]
    for name, fit in (("late", late), ("early", early)):
        if fit.size >= 2 and fit.mean() >= SHIFT_FIT:
            return name
    return None


def values_fit_shift(row: dict[str, Any]) -> bool | None:
    """Whether the trainer's logprobs follow its ids' shift (`shift_direction`): the row read one token over
    (`read_over`) fits `SignatureConfig.shift_min_gain` times better than read straight, as a read one token
    late or early does; False where it fits no better (the trainer scored other ids in another context: the
    engine's text re-tokenized); None where the ids show no shift or the straight |d| is under
    `shift_min_abs_diff` (too little to tell)."""
    moved = read_over(row)
    if moved is None or not moved.size:
        return None
    cfg, straight = SignatureConfig(), float(abs_diff(row).mean())
    if straight < cfg.shift_min_abs_diff:
        return None
    return bool(straight >= cfg.shift_min_gain * float(moved.mean()))


def read_over(row: dict[str, Any]) -> np.ndarray | None:
    """|d| of a row whose ids moved by one (`shift_direction`) read one token over in that direction:
    logp_train[t] against logp_rollout[t + 1] for a read late, [t - 1] for one early, over the pairs compared
    on both tokens (mask, finite); None where the ids show no shift."""
    engine, trainer = ids(row, "response_tokens"), ids(row, "tokens_train")
    if engine is None or trainer is None or engine.shape != trainer.shape or engine.size < 3:
        return None
    direction = shift_direction(engine, trainer, first_difference(row))
    if direction is None:
        return None
    lr, lt = np.asarray(row["logp_rollout"], np.float64), np.asarray(row["logp_train"], np.float64)
    keep = np.ones(lr.size, dtype=bool) if row.get("mask") is None else np.asarray(row["mask"], dtype=bool)
    d = lt[:-1] - lr[1:] if direction == "late" else lt[1:] - lr[:-1]
    both = keep[:-1] & keep[1:] & np.isfinite(d)
    return np.abs(d[both])


def first_difference(row: dict[str, Any]) -> int:
    """The first position where the two sides' response ids differ (the length if none)."""
    engine, trainer = ids(row, "response_tokens"), ids(row, "tokens_train")
    diff = np.flatnonzero(engine != trainer)
    return int(diff[0]) if diff.size else int(engine.size)


def prompt_lengths(rows: list[dict[str, Any]]) -> np.ndarray | None:
    """(N,) each row's prompt length (the engine's prompt ids), None when a row has none."""
    out = [ids(row, "prompt_tokens") for row in rows]
    return None if any(p is None for p in out) else np.array([p.size for p in out], dtype=np.int64)


def left_padding(rows: list[dict[str, Any]]) -> np.ndarray | None:
    """(N,) the pad tokens each row's prompt gets when the step's prompts are left-padded to the longest."""
    lengths = prompt_lengths(rows)
    return None if lengths is None or not lengths.size else lengths.max() - lengths


def trainer_prompts(rows: list[dict[str, Any]]) -> list[np.ndarray] | None:
    """The trainer's prompt ids of every row (`PROMPT_TOKENS_TRAIN`), None when a row lacks them."""
    out = [ids(row, PROMPT_TOKENS_TRAIN) for row in rows]
    return None if any(p is None for p in out) or prompt_lengths(rows) is None else out


def positions(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(M,) every response token's position in its sequence (prompt length + index; the index alone
    without prompt ids) and (M,) its |d|."""
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0)
    lengths = prompt_lengths(rows)
    starts = np.zeros(len(rows), np.int64) if lengths is None else lengths
    pos = [np.arange(len(row["logp_rollout"])) + p for row, p in zip(rows, starts.tolist(), strict=True)]
    return np.concatenate(pos), np.concatenate([abs_diff(row) for row in rows])


def shared_prefix(rows: list[dict[str, Any]]) -> np.ndarray | None:
    """(N,) for each row, the longest prompt prefix it shares with a row of another prompt (other ids)."""
    prompts = [ids(row, "prompt_tokens") for row in rows]
    if any(p is None for p in prompts):
        return None
    distinct = {tuple(p.tolist()) for p in prompts}
    keys = [tuple(p.tolist()) for p in prompts]
    best = {k: max((_common(k, o) for o in distinct if o != k), default=0) for k in distinct}
    return np.array([best[k] for k in keys], dtype=np.int64)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def separated(off: np.ndarray, hit: np.ndarray, share: float = 0.8) -> bool:
    """Whether the rows `hit` (bool (N,)) are the off ones: at least `share` of them above a cut halfway
    (in log) between the two groups' median mean |d|, and `share` of the others at or below it (a stale
    prefix one update old: its rows 9e-5 to 1e-3 apart, the others 1e-6)."""
    if not hit.any() or hit.all():
        return False
    cut = float(np.sqrt(max(np.median(off[hit]), 1e-12) * max(np.median(off[~hit]), 1e-12)))
    return bool(np.mean(off[hit] > cut) >= share and np.mean(off[~hit] <= cut) >= share)
