"""The cross-turn invariants of a multi-turn batch (`StepBatch.turns`): what must hold between an agent
loop's engine calls and the sequence the trainer learns from, checked per sequence, each breach with its
evidence. numpy only.

| invariant       | holds when                                                                      |
|-----------------|---------------------------------------------------------------------------------|
| prefix_break    | call k+1's prompt extends call k's prompt + output (with the declared join       |
|                 | edits), and equals the trained ids before turn k+1 (the trainer conditions each  |
|                 | turn on what the engine saw): retokenized or stripped history, a missing         |
|                 | generation prompt break it                                                       |
| zero_logprobs   | no compared token with an engine logprob of exactly 0.0 sits at a turn's end or  |
|                 | in a run of `zero_run`, where the trainer is not as sure (lp <= -`zero_tol`): a  |
|                 | join token or tool output in the loss, logprobs filled with 0.0                  |
| logprob_count   | each call returned one logprob per sampled id, and the trained turn holds the    |
|                 | ids it sampled (one id short or long per turn: a join token mis-handled)         |
| turn_count      | the turns found agree with the framework's own count (`TurnRecord.num_turns`)    |
| stale_turn      | every call's weights version is within `MonitorConfig.max_weight_lag` of the     |
|                 | trainer's                                                                        |
| tool_in_loss    | no token the adapter marked as tool / observation is in the loss mask            |

`check(batch, cfg, trainer_version, max_weight_lag) -> TurnVerdict`: per invariant the (N,) sequences
that break it and the evidence of the first few (turn, offset in the turn, expected vs actual ids);
the stale turns' tokens (masked out of the step when `TurnCheckConfig.mask_stale_turns`, the sequence
kept). The Monitor turns the verdict into alarms and quarantines the rows (`rlcheck.core.turn_alarms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
from rlcheck.core.turns import TurnRecord, Turns
from rlcheck.errors import ConfigError

MAX_EVIDENCE = 5
"""Sequences whose evidence an alarm carries, per invariant."""
SHOWN_IDS = 8
"""Ids shown on each side of a prefix break."""


@dataclass(frozen=True)
class TurnCheckConfig:
    """The cross-turn invariants the Monitor checks on batches with turns (docs/multiturn.md)."""

    checks: tuple[str, ...] = K.TURN_INVARIANTS
    """The invariants checked (`rlcheck.core.metrics.TURN_INVARIANTS`)."""
    zero_run: int = 4
    """Compared tokens in a row with an engine logprob of exactly 0.0 that break `zero_logprobs`."""
    zero_tol: float = 1e-3
    """...where the trainer's logprob is at most -zero_tol: an fp32 engine reports exactly 0.0 for a token it
    gives p > 1 - 6e-8, and a trainer that agrees says as much; one below p = 0.999 does not agree."""
    mask_stale_turns: bool = True
    """Mask the tokens of stale turns out of the step and keep the sequence (False: quarantine the sequence)."""

    def __post_init__(self) -> None:
        unknown = set(self.checks) - set(K.TURN_INVARIANTS)
        if isinstance(self.checks, str) or unknown:
            raise ConfigError(f"turn checks must be a tuple out of {K.TURN_INVARIANTS}, got {self.checks!r}")
        if self.zero_run < 2 or not self.zero_tol > 0:
            raise ConfigError(f"need zero_run >= 2 and zero_tol > 0, got {self.zero_run}, {self.zero_tol}")


@dataclass
class TurnVerdict:
    """What the invariants say of one batch."""

    broken: dict[str, np.ndarray]
    """invariant -> (N,) bool sequences that break it."""
    evidence: dict[str, list[dict]] = field(default_factory=dict)
    """invariant -> the first `MAX_EVIDENCE` breaches: request_id, index, turn, offset, what differs."""
    stale_tokens: np.ndarray | None = None
    """(M,) bool the tokens of stale turns (None when no turn is stale)."""
    zero_tokens: int = 0
    """Compared tokens with an engine logprob of exactly 0.0 where the trainer is not as sure."""

    def condemned(self, cfg: TurnCheckConfig) -> np.ndarray:
        """(N,) bool sequences to quarantine: every breach but a stale turn that masking handles."""
        num = next(iter(self.broken.values())).shape[0]
        out = np.zeros(num, dtype=bool)
        for name, flags in self.broken.items():
            if name != "stale_turn" or not cfg.mask_stale_turns:
                out |= flags
        return out

    def metrics(self) -> dict[str, float]:
        out = {K.turn_invariant(name): float(np.count_nonzero(flags)) for name, flags in self.broken.items()}
        out[K.TURN_MASKED_TOKENS] = float(0 if self.stale_tokens is None else np.count_nonzero(self.stale_tokens))
        out[K.TURN_ZERO_LP_COUNT] = float(self.zero_tokens)
        return out


def check(batch, cfg: TurnCheckConfig | None = None, trainer_version: int | None = None,
          max_weight_lag: int = 0) -> TurnVerdict:
    """The invariants of `cfg` on `batch` (which carries turns); see the module docstring."""
    cfg = cfg or TurnCheckConfig()
    turns: Turns = batch.turns
    num = batch.num_sequences
    verdict = TurnVerdict({name: np.zeros(num, dtype=bool) for name in cfg.checks})
    records = turns.records or (None,) * num
    runs = turns.runs(batch.cu_seqlens)
    per_seq = np.split(np.arange(runs.seq.shape[0]), np.searchsorted(runs.seq, np.arange(1, num)))
    if "zero_logprobs" in cfg.checks:
        _zero_logprobs(batch, cfg, verdict)
    if "tool_in_loss" in cfg.checks and turns.source == "explicit":
        _tool_in_loss(batch, verdict)
    stale = np.zeros(batch.num_tokens, dtype=bool)
    for i, rec in enumerate(records):
        if rec is None:
            continue
        mine = per_seq[i]
        starts, lengths = runs.start[mine] - batch.cu_seqlens[i], runs.length[mine]  # (K,) in the response
        found = {"prefix_break": _prefix(batch, i, rec, starts) if "prefix_break" in cfg.checks else None,
                 "logprob_count": _counts(rec, lengths, turns) if "logprob_count" in cfg.checks else None,
                 "turn_count": _turn_count(rec, lengths.shape[0]) if "turn_count" in cfg.checks else None}
        for name, evidence in found.items():
            if evidence is not None:
                _breach(verdict, name, batch, i, evidence)
        if "stale_turn" in cfg.checks and rec.versions is not None and trainer_version is not None:
            late = [k for k, v in enumerate(rec.versions) if trainer_version - v > max_weight_lag or v > trainer_version]
            if late:
                _breach(verdict, "stale_turn", batch, i, {"turns": late, "versions": list(rec.versions),
                                                          "trainer_version": trainer_version, "allowed_lag": max_weight_lag})
                for k in (k for k in late if k < mine.shape[0]):
                    a = int(runs.start[mine[k]])
                    stale[a:a + int(runs.length[mine[k]])] = True
    verdict.stale_tokens = stale if stale.any() else None
    return verdict


def _breach(verdict: TurnVerdict, name: str, batch, i: int, evidence: dict) -> None:
    verdict.broken[name][i] = True
    shown = verdict.evidence.setdefault(name, [])
    if len(shown) < MAX_EVIDENCE:
        shown.append({"request_id": batch.request_ids[i], "index": i, **evidence})


def first_difference(actual: np.ndarray, expected: np.ndarray, prefix_only: bool) -> int | None:
    """First position where `actual` differs from `expected` (one runs out first: its length); with
    `prefix_only`, `actual` need only start with `expected`."""
    n = min(actual.shape[0], expected.shape[0])
    diff = np.flatnonzero(actual[:n] != expected[:n])
    if diff.size:
        return int(diff[0])
    if actual.shape[0] < expected.shape[0] or (not prefix_only and actual.shape[0] != expected.shape[0]):
        return n
    return None


def classify(actual: np.ndarray, expected: np.ndarray, pos: int, window: int = 4, reach: int = 64) -> dict:
    """How `actual` departs from `expected` at `pos`: ids "deleted" (`expected` goes on `count` ids later),
    "inserted", "replaced" (`removed` ids by `added`, then the two agree again), "missing" (`actual` ends)
    or "extra"; "differs" when they do not agree again within `reach` ids."""
    if pos >= actual.shape[0]:
        return {"kind": "missing", "count": int(expected.shape[0] - pos)}
    if pos >= expected.shape[0]:
        return {"kind": "extra", "count": int(actual.shape[0] - pos)}
    for de in range(reach + 1):
        for da in range(min(reach, 4) + 1) if de else range(1, reach + 1):
            a, e = actual[pos + da:pos + da + window], expected[pos + de:pos + de + window]
            if a.shape[0] == e.shape[0] > 0 and (a == e).all():
                kind = "deleted" if da == 0 else "inserted" if de == 0 else "replaced"
                return {"kind": kind, "removed": de, "added": da}
    return {"kind": "differs"}


def trained_ids(batch, i: int, rec: TurnRecord) -> tuple[np.ndarray, int] | None:
    """(the ids the trainer saw: its prompt + the response, the prompt's length) of sequence i, or None
    when the batch holds no response ids."""
    response = batch.tokens_train if batch.tokens_train is not None else batch.tokens
    if response is None:
        return None
    theirs = batch.meta.get(PROMPT_TOKENS_TRAIN)
    prompt = theirs[i] if theirs is not None else (batch.prompt_tokens[i] if batch.prompt_tokens is not None
                                                    else (rec.prompt_ids[0] if rec.prompt_ids else None))
    if prompt is None:
        return None
    prompt = np.asarray(prompt, dtype=np.int64)
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    return np.concatenate([prompt, response[a:b]]), prompt.shape[0]


def _locate(pos: int, prompt_len: int, batch, i: int) -> dict:
    """Where position `pos` of sequence i's trained ids lies: the prompt, a turn's output or an observation."""
    if pos < prompt_len:
        return {"in": "prompt", "turn": None, "offset": pos}
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    r = pos - prompt_len
    if r >= b - a:
        return {"in": "end", "turn": None, "offset": r - (b - a)}
    tool, index = batch.turns.tool[a:b], batch.turns.index[a:b]
    start = r
    while start > 0 and tool[start - 1] == tool[r] and index[start - 1] == index[r]:
        start -= 1
    return {"in": "observation" if tool[r] else "output", "turn": int(index[r]), "offset": r - start}


def _prefix(batch, i: int, rec: TurnRecord, starts: np.ndarray) -> dict | None:
    """The first prefix break of sequence i's calls, or None."""
    prompts = rec.prompt_ids
    if not prompts:
        return None
    join = batch.turns.join
    trained = trained_ids(batch, i, rec)
    for k in range(len(prompts)):
        if k >= 1 and rec.output_ids is not None:
            out = rec.output_ids[k - 1] if join is None else join.edit(rec.output_ids[k - 1])
            expected = np.concatenate([prompts[k - 1], out])
            pos = first_difference(prompts[k], expected, prefix_only=True)
            if pos is not None:
                where = ({"in": "output", "turn": k - 1, "offset": pos - prompts[k - 1].shape[0]}
                         if pos >= prompts[k - 1].shape[0] or trained is None else _locate(pos, trained[1], batch, i))
                return {"call": k, "check": "extends the previous call", "position": pos, **where,
                        "expected": expected[pos:pos + SHOWN_IDS].tolist(),
                        "actual": prompts[k][pos:pos + SHOWN_IDS].tolist(), "edit": classify(prompts[k], expected, pos)}
        if trained is not None and k < starts.shape[0]:
            ids, prompt_len = trained
            context = ids[:prompt_len + int(starts[k])]  # what the trainer conditions turn k on
            pos = first_difference(context, prompts[k], prefix_only=False)
            if pos is not None:
                return {"call": k, "check": "equals the trained ids before the turn", "position": pos,
                        **_locate(pos, prompt_len, batch, i), "expected": prompts[k][pos:pos + SHOWN_IDS].tolist(),
                        "actual": context[pos:pos + SHOWN_IDS].tolist(), "edit": classify(context, prompts[k], pos)}
    return None


def _counts(rec: TurnRecord, lengths: np.ndarray, turns: Turns) -> dict | None:
    """The first turn whose logprob count, sampled ids and trained tokens disagree, or None."""
    for k in range(len(rec.logprob_counts or rec.output_ids or ())):
        sampled = None if rec.output_ids is None else rec.output_ids[k]
        kept = None if sampled is None else (sampled if turns.join is None else turns.join.edit(sampled))
        removed = 0 if sampled is None or kept.shape[0] >= sampled.shape[0] else sampled.shape[0] - kept.shape[0]
        trained = int(lengths[k]) if k < lengths.shape[0] else 0
        count = None if rec.logprob_counts is None else rec.logprob_counts[k]
        checks = []
        if count is not None and sampled is not None and count != sampled.shape[0]:
            checks.append(f"{count} logprobs for {sampled.shape[0]} sampled ids")
        if sampled is not None and trained != sampled.shape[0] - removed:
            checks.append(f"the trained turn holds {trained} tokens, the engine sampled {sampled.shape[0]}"
                          + (f" ({removed} removed by the declared join edit)" if removed else ""))
        if count is not None and sampled is None and count != trained:
            checks.append(f"{count} logprobs for the {trained} tokens of the trained turn")
        if checks:
            return {"turn": k, "offset": min(trained, count if count is not None else trained), "what": "; ".join(checks),
                    "trained_tokens": trained, "sampled": None if sampled is None else int(sampled.shape[0]),
                    "logprobs": count}
    return None


def _turn_count(rec: TurnRecord, found: int) -> dict | None:
    if rec.num_turns is None or int(rec.num_turns) == found:
        return None
    return {"turn": min(found, int(rec.num_turns)), "offset": 0, "found": found, "framework": int(rec.num_turns)}


def _zero_logprobs(batch, cfg: TurnCheckConfig, verdict: TurnVerdict) -> None:
    """Compared tokens with an engine logprob of exactly 0.0 the trainer is not sure of: in runs of
    `zero_run`, or at a turn's end (vectorised; evidence of the first few sequences)."""
    lr, lt = batch.logp_rollout, batch.logp_train
    compared = np.ones(lr.shape[0], dtype=bool) if batch.mask is None else batch.mask
    with np.errstate(invalid="ignore"):
        z = compared & (lr == 0.0) & (lt <= -cfg.zero_tol)  # (M,)
    verdict.zero_tokens = int(np.count_nonzero(z))
    if not verdict.zero_tokens:
        return
    turns, cu = batch.turns, batch.cu_seqlens
    runs = turns.runs(cu)
    ends = runs.start + runs.length - 1
    at_end = np.zeros_like(z)
    at_end[ends[runs.length > 0]] = True
    first, last = _seq_edge(z.shape[0], cu, 0), _seq_edge(z.shape[0], cu, -1)
    start = np.flatnonzero(z & (first | ~np.concatenate([[False], z[:-1]])))  # runs end at sequence edges
    stop = np.flatnonzero(z & (last | ~np.concatenate([z[1:], [False]]))) + 1
    seqs = np.searchsorted(cu, start, side="right") - 1
    ended = np.concatenate([[0], np.cumsum(at_end & z)])  # (M+1,) zero tokens at a turn's end so far
    hit = (stop - start >= cfg.zero_run) | (ended[stop] > ended[start])
    offsets = turns.offsets(cu)
    for a, b, seq in zip(start[hit], stop[hit], seqs[hit], strict=True):
        _breach(verdict, "zero_logprobs", batch, int(seq), {
            "turn": int(turns.index[a]), "offset": int(offsets[a]), "length": int(b - a),
            "at_turn_end": bool(ended[b] > ended[a]), "position": int(a - cu[seq]),
            "trainer_mean_logprob": float(np.mean(lt[a:b]))})


def _seq_edge(m: int, cu: np.ndarray, side: int) -> np.ndarray:
    """(M,) bool the first (side 0) or last (side -1) token of every non-empty sequence."""
    flags = np.zeros(m, dtype=bool)
    nonempty = np.diff(cu) > 0
    flags[cu[:-1][nonempty] if side == 0 else cu[1:][nonempty] - 1] = True
    return flags


def _tool_in_loss(batch, verdict: TurnVerdict) -> None:
    """Tokens the adapter marked as tool / observation that are in the loss mask."""
    compared = np.ones(batch.num_tokens, dtype=bool) if batch.mask is None else batch.mask
    bad = compared & batch.turns.tool
    if not bad.any():
        return
    cu = batch.cu_seqlens
    pos = np.flatnonzero(bad)
    seqs, first = np.unique(np.searchsorted(cu, pos, side="right") - 1, return_index=True)
    offsets = batch.turns.offsets(cu)
    for s, j in zip(seqs.tolist(), first.tolist(), strict=True):
        p = int(pos[j])
        _breach(verdict, "tool_in_loss", batch, s, {
            "turn": int(batch.turns.index[p]), "offset": int(offsets[p]), "position": int(p - cu[s]),
            "tokens": int(np.count_nonzero(bad[cu[s]:cu[s + 1]]))})
