"""Numeric limits every reader of logprobs shares (a leaf: the statistics and the correction import it)."""

RATIO_LOG_CAP = 50.0  # d above this is capped before exp: r <= e^50 ~ 5e21
MIN_LOGPROB = -1e4  # below this a "logprob" is a stand-in for -inf (-1e9, finfo.min): counted as non-finite
MAX_LOGPROB = 1e-3  # above this a "logprob" is a logit or a probability; bf16 log-softmax can land a hair above 0
FP32_ENGINE_TOL = 1e-3
"""Max |d| (nats) of a request that two float32 passes of the same model (vLLM vs the reference, decode
vs prefill) may differ by: they agree to ~1e-5 over thousands of requests (BENCHMARKS.md), while a
stale or aliased state is off by 0.1 to 20 nats."""
ENGINE_TOL = 0.5
"""The same for lower precisions: bf16 passes agree to ~0.1-0.2; a token whose probability is off by
e^0.5 = 1.65x is beyond precision noise."""

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
PRECISIONS = ("float32", "float16", "bfloat16")
"""Engine and reference dtypes, finest first: a judge of two sides takes the coarser one's tolerance."""


def dtype_name(dtype: object) -> str:
    """torch's name of a dtype given as a string or torch dtype ("bf16", "torch.float32" -> "bfloat16",
    "float32"); "auto" and unknown names are returned as they are."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def logprob_tolerance(*dtypes: object) -> float:
    """Max |d| (nats) of a request between two passes in these dtypes (the engine's, the reference's):
    FP32_ENGINE_TOL when all are float32, ENGINE_TOL otherwise ("auto" or unknown: the loosest)."""
    return FP32_ENGINE_TOL if all(dtype_name(d) == "float32" for d in dtypes) else ENGINE_TOL
