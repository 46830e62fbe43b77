"""Per-turn statistics of a multi-turn batch (`StepBatch.turns`): the token statistics of turn 0..7, of
each sequence's last turn, of every turn from the second on, and of the turns' heads (the first
`StatsConfig.turn_head_tokens` tokens after an observation) against their bodies; the worst turn, the
slope across turns. Logged as `rlcheck/turn/<slot>/<stat>` (`rlcheck.core.metrics`). A batch without
turns costs nothing here.

The model turns are cut into segments, two per turn (head, body), with the tool runs between them as
segments of their own that nothing counts; every sum is one `np.add.reduceat` over those segment
starts (`segment_sums`), so per-turn statistics take a fixed handful of passes over the tokens,
whatever the number of turns. The torch path sums the same segments on the device
(`rlcheck.core.stats.torch_partial`) and shares the rest. Mergeable: every quantity is a sum or a
maximum under `PartialStats.sums` / `maxima` keys "turn/<slot>/<q>".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.turns import Turns
from rlcheck.core.types import Offender

QUANTITIES = ("n", "ad", "ad_clip", "d", "e", "pdiff", "cat")
"""Per segment, summed over its valid tokens: count, |d|, min(|d|, clip), d, r - 1, |p_t - p_r|, catastrophic."""
SUM_KEYS = tuple(f"turn/{slot}/{q}" for slot in K.TURN_SLOTS for q in QUANTITIES)  # slot-major, as slot_parts
TURNS_KEYS = tuple(f"turn/{slot}/turns" for slot in K.TURN_SLOTS)
MAX_KEYS = tuple(f"turn/{slot}/ad" for slot in K.TURN_SLOTS)
_NAMES = {slot: ({**{q: f"turn/{slot}/{q}" for q in (*QUANTITIES, "turns")}, "max": f"turn/{slot}/ad"},
                 {stat: K.turn_metric(slot, stat) for stat in K.TURN_STATS}) for slot in K.TURN_SLOTS}
"""Per slot: (its partial's sum keys, its metric keys), built once."""
RATIO_FLOOR = 1e-3
"""Added to both levels (clipped mean |d|) of a ratio: an fp32 run's 1e-7 against 3e-7 is no spike (ratio
1.0002), a later turn at 2e-3 where turn 0 sits at 1e-7 is (ratio 3); smooth, so a rolling baseline of the
ratio never sees a run of exact 1.0 (a clamp's) and a MAD of 0."""


@dataclass(frozen=True)
class Segments:
    """The segments of one batch's tokens (S of them, in token order, covering every token)."""

    starts: np.ndarray  # (S,) int64 first token of each
    model: np.ndarray  # (S,) bool a part of a model turn (else a tool run)
    turn: np.ndarray  # (S,) int64 its turn number
    last: np.ndarray  # (S,) bool of its sequence's last turn
    head: np.ndarray  # (S,) bool a turn's first tokens (else its body)

    def token_segment(self, num_tokens: int) -> np.ndarray:
        """(M,) int64 the segment of every token (for the torch path's index_add)."""
        flags = np.zeros(num_tokens, dtype=np.int64)
        flags[self.starts] = 1
        return np.cumsum(flags) - 1


def segments(turns: Turns, cu: np.ndarray, head_tokens: int) -> Segments:
    """The head/body segments of every model turn and the tool runs between (see the module docstring)."""
    runs = turns.runs(cu)
    begin = runs.begin  # every run, both kinds
    split = runs.start + np.minimum(head_tokens, runs.length)
    split = split[runs.length > head_tokens]  # a body follows the head
    starts = np.concatenate([begin, split])
    head = np.concatenate([np.ones(begin.shape[0], bool), np.zeros(split.shape[0], bool)])
    order = np.argsort(starts, kind="stable")
    starts, head = starts[order], head[order]
    model = ~turns.tool[starts]
    turn = turns.index[starts].astype(np.int64)
    last = _last_turn(starts, model, runs)
    return Segments(starts, model, turn, last, head & model)


def _last_turn(starts: np.ndarray, model: np.ndarray, runs) -> np.ndarray:
    """(S,) bool: segments of a sequence's last model turn (its head and its body)."""
    run = np.searchsorted(runs.start, starts, side="right") - 1  # (S,) the model run at or before each segment
    return model & (run >= 0) & runs.last[np.maximum(run, 0)]


def segment_sums(values: dict[str, np.ndarray | None], ad: np.ndarray, seg: Segments,
                 num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """((S, Q) float64 sums of `QUANTITIES` per segment, (S,) max |d|): a value None counts every token
    (the count of a batch with every token valid)."""
    lens = np.diff(np.append(seg.starts, num_tokens)).astype(np.float64)  # (S,)
    cols = [lens if values[q] is None else np.add.reduceat(values[q], seg.starts, dtype=np.float64)
            for q in QUANTITIES]
    return np.stack(cols, axis=1), np.maximum.reduceat(ad, seg.starts).astype(np.float64)


def _tool_tokens(runs, num_tokens: int) -> int:
    """The tool / observation tokens: the tokens outside the model's runs."""
    return num_tokens - int(runs.length.sum())


def slot_parts(seg: Segments, sums: np.ndarray, seg_max: np.ndarray, counts: np.ndarray,
               tool_tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """The partial's "turn/..." sums and maxima from the segments' sums: per slot of `K.TURN_SLOTS`,
    and the batch's turn counts (`counts`: (N,) model turns per sequence). One (S, slots) membership
    matrix: the slots' sums are one matrix product, their maxima one masked reduction."""
    model, later = seg.model, seg.model & (seg.turn >= 1)
    member = np.zeros((seg.starts.shape[0], len(K.TURN_SLOTS)), dtype=bool)  # (S, slots)
    numbered = model & (seg.turn <= K.TURN_MAX_INDEX)
    member[np.flatnonzero(numbered), seg.turn[numbered]] = True
    first = K.TURN_MAX_INDEX + 1
    member[:, first] = model & seg.last
    member[:, first + 1] = later
    member[:, first + 2] = later & seg.head
    member[:, first + 3] = later & ~seg.head
    totals = member.T.astype(np.float64) @ sums  # (slots, Q)
    tops = np.where(member, seg_max[:, None], -math.inf).max(axis=0) if member.size else np.full(member.shape[1],
                                                                                                 -math.inf)
    starts = member & (seg.head | ~model)[:, None]  # one head segment per turn (a body segment for "body")
    starts[:, first + 3] = member[:, first + 3]
    turns = starts.sum(axis=0)
    out_sums: dict[str, float] = {"turn/count": float(counts.sum()), "turn/seqs": float(counts.shape[0]),
                                  "turn/tool_tokens": float(tool_tokens)}
    out_sums.update(zip(SUM_KEYS, totals.ravel().tolist(), strict=True))
    out_sums.update(zip(TURNS_KEYS, turns.astype(np.float64).tolist(), strict=True))
    out_max: dict[str, float] = {"turn/per_seq_max": float(counts.max()) if counts.size else 0.0}
    out_max.update(zip(MAX_KEYS, tops.tolist(), strict=True))
    return out_sums, out_max


@dataclass(frozen=True)
class TurnPass:
    """What `turn_partial` leaves for the rest of compute_partial: the segments (for the offenders) and the
    (M,) min(|d|, clip) and |d| >= catastrophic_tau it computed (the step's own sums reuse them)."""

    seg: Segments
    ad_clip: np.ndarray
    cat: np.ndarray


def turn_partial(batch, cfg, d, ad, e, pdiff, valid, sums: dict[str, float], maxima: dict[str, float]) -> TurnPass:
    """Add the "turn/..." sums and maxima of a numpy batch with turns to `sums` and `maxima`, from
    compute_partial's (M,) arrays (invalid tokens hold d = 0)."""
    turns, cu = batch.turns, batch.cu_seqlens
    seg = segments(turns, cu, cfg.turn_head_tokens)
    ad_clip, cat = np.minimum(ad, cfg.clip), ad >= cfg.catastrophic_tau
    values = {"n": None if valid is None else valid, "ad": ad, "ad_clip": ad_clip, "d": d, "e": e,
              "pdiff": pdiff, "cat": cat}
    seg_sums, seg_max = segment_sums(values, ad, seg, batch.num_tokens)
    tool = turns.runs(cu)
    found, top = slot_parts(seg, seg_sums, seg_max, turns.turn_counts(cu), _tool_tokens(tool, batch.num_tokens))
    sums.update(found)
    maxima.update(top)
    return TurnPass(seg, ad_clip, cat)


def turn_positions(offenders: tuple[Offender, ...], batch, seg: Segments) -> tuple[Offender, ...]:
    """The offenders with the turn and the offset in it of their first divergence (a tool token's:
    the turn it follows, its offset in the observation)."""
    diverged = [o for o in offenders if o.first_divergence is not None]
    if not diverged:
        return offenders
    begin = seg.starts[seg.head | ~seg.model]  # (R',) the first token of every run
    pos = np.array([int(batch.cu_seqlens[o.index]) + o.first_divergence for o in diverged], dtype=np.int64)
    offset = pos - begin[np.searchsorted(begin, pos, side="right") - 1]
    found = {id(o): (t, f) for o, t, f in zip(diverged, batch.turns.index[pos].tolist(), offset.tolist(), strict=True)}
    return tuple(o if id(o) not in found else replace(o, turn=found[id(o)][0], turn_offset=found[id(o)][1])
                 for o in offenders)


def turn_metrics(s: dict[str, float], mx: dict[str, float]) -> dict[str, float]:
    """The `rlcheck/turn/*` metrics of merged partial statistics ({} without turns); a slot without a
    valid token logs its counts only."""
    if "turn/count" not in s:
        return {}
    seqs = max(s["turn/seqs"], 1.0)
    out = {K.TURN_COUNT: s["turn/count"], K.TURN_PER_SEQ_MEAN: s["turn/count"] / seqs,
           K.TURN_PER_SEQ_MAX: mx["turn/per_seq_max"], K.TURN_TOOL_TOKENS: s["turn/tool_tokens"]}
    level: dict[str, float] = {}
    for slot, (sum_key, out_key) in _NAMES.items():
        n = s[sum_key["n"]]
        out[out_key["tokens"]] = n
        out[out_key["turns"]] = s[sum_key["turns"]]
        if n <= 0:
            continue
        level[slot] = s[sum_key["ad_clip"]] / n
        out[out_key["abs_diff_mean"]] = s[sum_key["ad"]] / n
        out[out_key["abs_diff_clipped_mean"]] = level[slot]
        out[out_key["abs_diff_max"]] = mx[sum_key["max"]]
        out[out_key["diff_mean"]] = s[sum_key["d"]] / n
        out[out_key["kl_k1"]] = -s[sum_key["d"]] / n
        out[out_key["kl_k3"]] = max((s[sum_key["e"]] - s[sum_key["d"]]) / n, 0.0)
        out[out_key["prob_abs_diff_mean"]] = s[sum_key["pdiff"]] / n
        out[out_key["catastrophic_frac"]] = s[sum_key["cat"]] / n
    out.update(_shape_metrics(level))
    return out


def _shape_metrics(level: dict[str, float]) -> dict[str, float]:
    """Worst turn, slope across turns, later turns and heads against their reference."""
    out: dict[str, float] = {}
    per_turn = {int(k): v for k, v in level.items() if k.isdigit()}
    if per_turn:
        worst = max(per_turn, key=lambda t: (per_turn[t], -t))
        out[K.TURN_WORST], out[K.TURN_WORST_LEVEL] = float(worst), per_turn[worst]
    if len(per_turn) >= 2:
        t = np.array(sorted(per_turn), dtype=np.float64)
        y = np.array([per_turn[int(k)] for k in t])
        out[K.TURN_SLOPE] = float(np.polyfit(t, y, 1)[0])
    if "later" in level and "0" in level:
        out[K.TURN_LATER_RATIO] = (level["later"] + RATIO_FLOOR) / (level["0"] + RATIO_FLOOR)
    if "head" in level and "body" in level:
        out[K.TURN_HEAD_BODY_RATIO] = (level["head"] + RATIO_FLOOR) / (level["body"] + RATIO_FLOOR)
    return out
