"""GRPO/PPO math, pure: group-normalised advantages and the clipped surrogate loss."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rlcheck.errors import InputError


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6, scale: bool = True) -> np.ndarray:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (if `scale`).

    `rewards` is (num_prompts * group_size,), prompt-major (the G samples of a prompt are adjacent).
    A group whose samples all scored the same gets advantage 0 (it carries no signal).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or r.ndim != 1 or r.size % group_size:
        raise InputError(f"rewards ({r.shape}) must be 1-D with a multiple of group_size={group_size} entries")
    g = r.reshape(-1, group_size)  # (P, G)
    adv = g - g.mean(axis=1, keepdims=True)
    adv[(g == g[:, :1]).all(axis=1)] = 0.0  # exactly: the mean of equal floats can be an ulp off
    if scale:
        adv = adv / (g.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1).astype(np.float32)


class SurrogateTerms(NamedTuple):
    loss_sum: torch.Tensor
    """Sum over tokens of the per-token loss (divide by the global token count)."""
    clipped: torch.Tensor
    """Number of tokens whose ratio was clipped (the gradient is zero there)."""
    ratio_max: torch.Tensor


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float, weights: torch.Tensor | None = None) -> SurrogateTerms:
    """PPO's clipped objective per token, summed:

        r = exp(logp - old_logp);  loss_t = -w_t * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    All arguments are (T,) over the response tokens (advantages already broadcast to tokens);
    `weights` w (detached; None: 1) are the rollout correction's (verl's `rollout_is_weights`, 0 for a
    quarantined or rejected token), so a token of weight 0 neither moves the weights nor counts as clipped.
    """
    ratio = torch.exp(logp - old_logp)  # (T,)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if weights is not None:
        per_token = per_token * weights.detach()
        was_clipped &= weights > 0
    return SurrogateTerms(
        loss_sum=per_token.sum(),
        clipped=was_clipped.sum(),
        ratio_max=ratio.detach().max() if ratio.numel() else torch.zeros(()),
    )
