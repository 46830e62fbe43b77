"""Numeric limits every reader of logprobs shares (a leaf: the statistics and the correction import it)."""

RATIO_LOG_CAP = 50.0  # d above this is capped before exp: r <= e^50 ~ 5e21
MIN_LOGPROB = -1e4  # below this a "logprob" is a stand-in for -inf (-1e9, finfo.min): counted as non-finite
