"""Per-step mismatch statistics over packed tokens, in two stages so that ranks can merge:

    partial = compute_partial(batch, cfg)      # sums, counts, extrema, histograms, top-K offenders
    partial = merge([p_rank0, p_rank1, ...])   # exact: sums add, extrema combine, histograms add
    metrics, offenders = finalize(partial, cfg)

`compute(batch, cfg)` does all three for one process. Everything is vectorised over tokens (segment
reductions, no Python loop over sequences), in one of two implementations that give the same
PartialStats (`StatsConfig.backend`, or RLCHECK_STATS_BACKEND=numpy|torch|torch-eager; the choice is
`rlcheck.core.stats.backend`):

    torch  (`torch_partial`, `torch_kernels`, `torch_sequences`, `torch_distribution`) on a batch
           built from GPU tensors (`StepBatch.device_tensors`): on their device, two small
           device-to-host copies per batch; on any batch when asked for ("torch-eager", or "torch":
           the token pass through torch.compile), a numpy batch read zero-copy
    numpy  (`partial`, `sequences`, `signatures`, `distribution`: `np.*.reduceat`) on every host
           batch by default (faster than eager torch on a CPU at every size measured); `import rlcheck`
           never imports torch, the torch path imports it on first use

With d = logp_train - logp_rollout, r = exp(d) and n valid tokens, the token metrics are

    kl_k1 = mean(-d)   kl_k2 = mean(d^2 / 2)   kl_k3 = mean(r - 1 - d)   chi2 = mean(r^2) - 1
    mult_prob_error = mean(exp|d|)             prob_abs_diff = |exp(logp_train) - exp(logp_rollout)|

computed as expm1(d) so that nothing cancels for tiny d; d is capped at RATIO_LOG_CAP before any
exponential (so nothing overflows) and the capped tokens are counted in `ratio/clipped_count`.
Non-finite tokens (NaN, -inf, or a sentinel below MIN_LOGPROB such as -1e9, on either side, and not
masked out) are left out of every statistic, counted in `token/nonfinite_count`, and mark their
sequence as flagged and catastrophic.
"""

from __future__ import annotations

from rlcheck.core.batch import StepBatch
from rlcheck.core.stats.finalize import finalize
from rlcheck.core.stats.partial import compute_partial, empty_partial
from rlcheck.core.stats.types import MIN_LOGPROB, RATIO_LOG_CAP, Offender, PartialStats, StatsConfig, merge


def compute(batch: StepBatch, cfg: StatsConfig | None = None) -> tuple[dict[str, float], tuple[Offender, ...]]:
    """Metrics and offenders of one batch in this process."""
    cfg = cfg or StatsConfig()
    return finalize(compute_partial(batch, cfg), cfg)


__all__ = [
    "MIN_LOGPROB", "RATIO_LOG_CAP", "Offender", "PartialStats", "StatsConfig", "compute", "compute_partial",
    "empty_partial", "finalize", "merge",
]
