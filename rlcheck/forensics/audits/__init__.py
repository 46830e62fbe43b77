"""Engine self-audits: the rollout engine checked against itself, no trainer and no reference needed.

    prefill = rescore_prefill(engine.llm, prompts, responses)            # (L_i,) per request
    audit = DecodePrefill.of(request_ids, prefill, decode_logprobs, threshold=1e-3)
    audit.failing_request_ids                                            # decode != fresh prefill
    inv = BatchInvariance.of(request_ids, {"max_num_seqs=64": rollouts, "max_num_seqs=1": serial, ...})
    inv.requests_differing, inv.distinct_outputs, inv.max_abs_diff

- decode vs prefill: a sequence scored by a fresh prefill of prompt + response must get the logprobs it
  was sampled with during decode. `rescore_prefill` asks the same engine for the prompt logprobs of
  prompt + response (one generated token, the prefix cache not read, `batch_size` requests at a time);
  a request fails when its max |prefill - decode| over the response exceeds the threshold. A state
  that was stale or shared while the request decoded (the two Mamba bugs of the design notes) shows
  here; a fault that corrupts prefill and decode alike (a wrong weight) does not: that is the
  reference's job. vLLM computes prompt logprobs from the unscaled logits (T = 1), so the decode
  logprobs must be too: greedy, or temperature 1 without logit processing.
- batch invariance: the same greedy requests run at several concurrencies and arrival orders must
  give the same tokens and logprobs. Per request: how many distinct outputs the runs gave, the first
  token where they part, and max |d| of the logprobs over the tokens before that (after it the
  contexts differ). Arithmetic that depends on the batch (kernel choice, reduction order) shows as
  small |d| at fp32 and as changed tokens at bf16; a state fault that depends on the load as many.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.errors import ConfigError
from rlcheck.forensics.stress.config import AUDITS, parse_audits  # noqa: F401 - re-exported

RESCORE_BATCH = 256
"""Requests per `rescore_prefill` call to the engine."""
MAX_LISTED = 200
"""Request ids an audit's JSON lists (the counts are always whole)."""


def rescore_prefill(llm: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                    batch_size: int = RESCORE_BATCH,
                    progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
    """The engine's own logprob of every response token from a fresh prefill of prompt + response:
    (len(response),) float32 per request, in order, `batch_size` requests per call of `llm` (a
    `vllm.LLM`; `rlcheck.engines.fingerprint.score_tokens` per batch)."""
    from rlcheck.engines.fingerprint import score_tokens

    if len(prompts) != len(responses):
        raise ConfigError(f"{len(prompts)} prompts for {len(responses)} responses")
    out: list[np.ndarray] = []
    for a in range(0, len(prompts), batch_size):
        out += score_tokens(llm, [list(p) for p in prompts[a:a + batch_size]], [list(r) for r in responses[a:a + batch_size]])
        if progress is not None:
            progress(len(out), len(prompts))
    return out


@dataclass(frozen=True)
class DecodePrefill:
    """The decode-prefill audit of some requests: per request, max |prefill - decode| over its response."""

    request_ids: tuple[str, ...]
    max_abs_diff: tuple[float, ...]  # inf: a non-finite logprob on either side
    first_divergence: tuple[int | None, ...]  # first response token over the threshold
    threshold: float
    seconds: float = 0.0

    @classmethod
    def of(cls, request_ids: Sequence[str], prefill: Sequence[np.ndarray], decode: Sequence[np.ndarray], *,
           threshold: float, seconds: float = 0.0) -> DecodePrefill:
        from rlcheck.core.stats.sequences import request_divergence

        scores, first = request_divergence(prefill, decode, threshold)
        return cls(tuple(map(str, request_ids)), tuple(map(float, scores)), tuple(first), threshold, seconds)

    @property
    def failing(self) -> list[int]:
        return [i for i, m in enumerate(self.max_abs_diff) if m > self.threshold]

    @property
    def failing_request_ids(self) -> list[str]:
        return [self.request_ids[i] for i in self.failing]

    def to_dict(self) -> dict[str, Any]:
        failing = self.failing
        return {
            "num_requests": len(self.request_ids), "num_failing": len(failing),
            "failing_request_ids": [self.request_ids[i] for i in failing],
            "max_abs_diff": max(self.max_abs_diff, default=0.0), "threshold": self.threshold,
            "seconds": self.seconds,
            "failing": [{"request_id": self.request_ids[i], "max_abs_diff": self.max_abs_diff[i],
                         "first_divergence": self.first_divergence[i]} for i in failing[:MAX_LISTED]],
        }


@dataclass(frozen=True)
class BatchInvariance:
    """The same requests under several runs (concurrency, arrival order): how their outputs differ."""

    request_ids: tuple[str, ...]
    runs: tuple[str, ...]  # what each run was, the first the one compared against
    distinct: tuple[int, ...]  # per request: distinct token outputs over the runs (1: invariant)
    first_difference: tuple[int | None, ...]  # first response token where any run differs
    max_abs_diff: tuple[float, ...]  # max |d| of the logprobs over the tokens before it
    threshold: float
    seconds: float = 0.0

    @classmethod
    def of(cls, request_ids: Sequence[str], runs: Mapping[str, tuple[Sequence[Sequence[int]], Sequence[np.ndarray]]],
           *, threshold: float, seconds: float = 0.0) -> BatchInvariance:
        """`runs`: name -> (token ids, logprobs) per request, in `request_ids` order, the first run the base."""
        names = list(runs)
        if len(names) < 2:
            raise ConfigError("batch invariance needs at least two runs")
        distinct, first, worst = [], [], []
        for i in range(len(request_ids)):
            outs = [(tuple(int(t) for t in runs[n][0][i]), np.asarray(runs[n][1][i], dtype=np.float64)) for n in names]
            distinct.append(len({toks for toks, _ in outs}))
            part = min(_first_difference(outs[0][0], toks) for toks, _ in outs[1:])
            first.append(None if part == math.inf else int(part))
            n = int(min(part, len(outs[0][0])))
            worst.append(max((_max_abs(outs[0][1][:n], lp[:n]) for _, lp in outs[1:]), default=0.0))
        return cls(tuple(map(str, request_ids)), tuple(names), tuple(distinct), tuple(first), tuple(worst),
                   threshold, seconds)

    @property
    def differing(self) -> list[int]:
        """Requests whose tokens differ between runs, or whose logprobs differ past the threshold."""
        return [i for i, (k, m) in enumerate(zip(self.distinct, self.max_abs_diff, strict=True))
                if k > 1 or m > self.threshold]

    @property
    def requests_differing(self) -> int:
        return len(self.differing)

    @property
    def distinct_outputs(self) -> int:
        """The most distinct outputs any request got (1: every request the same in every run)."""
        return max(self.distinct, default=1)

    def to_dict(self) -> dict[str, Any]:
        differing = self.differing
        counts = {str(k): self.distinct.count(k) for k in sorted(set(self.distinct))}
        return {
            "runs": list(self.runs), "num_requests": len(self.request_ids),
            "distinct_outputs": self.distinct_outputs, "requests_by_distinct_outputs": counts,
            "requests_differing": len(differing),
            "requests_tokens_differing": sum(k > 1 for k in self.distinct),
            "max_abs_diff": max(self.max_abs_diff, default=0.0), "threshold": self.threshold,
            "seconds": self.seconds,
            "differing": [{"request_id": self.request_ids[i], "distinct_outputs": self.distinct[i],
                           "first_difference": self.first_difference[i], "max_abs_diff": self.max_abs_diff[i]}
                          for i in differing[:MAX_LISTED]],
        }


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """First position where two token sequences differ (a length difference counts); inf if equal."""
    if a == b:
        return math.inf
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0:
        return 0.0
    d = np.abs(a - b)
    return math.inf if not np.isfinite(d).all() else float(d.max())
