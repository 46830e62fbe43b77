"""The engine self-audits of a stress run (`StressConfig.audits`), run around its generation.

    audits, prefill, shuffled = engine_audits(engine, cfg, prompts, rollouts, progress)   # engine still up
    serial = serial_run(cfg, prompts, progress, cache)                                   # its own engine
    audits["batch_invariance"] = batch_invariance(cfg, rollouts, shuffled, serial)

On the stress run's engine, once its generation is done and an injected state fault removed (it stands
for one that the stress load brings out: the audits' own passes run without it; a perturbed layer, a
wrong weight, stays on, so that the audits see it as they would a real one: not at all):
- decode-prefill: every request re-scored by a fresh prefill (`rlcheck.forensics.audits.rescore_prefill`);
- batch-invariance, shuffled: the same prompts again in a seeded random arrival order.
Then, after that engine is closed, batch-invariance's serial run (`rlcheck.forensics.stress.serial_run`):
a second engine with max_num_seqs 1 (one request at a time), no fault; a sweep passes a cache so that
one serial run serves every point whose serial settings are the same (a max_num_seqs sweep runs it once).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from rlcheck.forensics.audits import BatchInvariance, DecodePrefill, rescore_prefill
from rlcheck.forensics.stress.config import Progress, StressConfig

Outputs = tuple[list[tuple[int, ...]], list[np.ndarray]]
"""(token ids, logprobs) per request, in arrival order."""


class EngineAudits(NamedTuple):
    audits: dict[str, Any]  # "decode_prefill": DecodePrefill, when asked for
    prefill: list[np.ndarray] | None  # the fresh prefill's logprobs, arrival order
    shuffled: Outputs | None  # the shuffled run's outputs, arrival order
    shuffled_seconds: float


def engine_audits(engine: Any, cfg: StressConfig, prompts: list[list[int]], rollouts: list[Any],
                  progress: Progress | None) -> EngineAudits:
    """The audits that run on the stress run's engine (see the module docstring)."""
    audits: dict[str, Any] = {}
    prefill = shuffled = None
    if "decode-prefill" in cfg.audits:
        t = time.perf_counter()
        report = None if progress is None else (lambda d, n: progress("audit: decode vs prefill (requests)", d, n))
        prefill = rescore_prefill(engine.llm, prompts, [r.token_ids for r in rollouts], progress=report)
        audits["decode_prefill"] = DecodePrefill.of(
            [r.vllm_request_id for r in rollouts], prefill, [r.logprobs for r in rollouts],
            threshold=cfg.fail_threshold, seconds=time.perf_counter() - t)
    t = time.perf_counter()
    if "batch-invariance" in cfg.audits:
        if progress is not None:
            progress("audit: shuffled arrival order", 0, len(prompts))
        order = np.random.default_rng([cfg.seed, 0xA0D17]).permutation(len(prompts))  # (N,) run j sends prompt order[j]
        again = engine.generate([prompts[i] for i in order], step=1)
        shuffled: Outputs = ([()] * len(prompts), [np.zeros(0, np.float32)] * len(prompts))
        for j, r in zip(order, again, strict=True):
            shuffled[0][j], shuffled[1][j] = r.token_ids, r.logprobs
    return EngineAudits(audits, prefill, shuffled, time.perf_counter() - t)


def batch_invariance(cfg: StressConfig, request_ids: tuple[str, ...], rollouts: list[Any], shuffled: Outputs,
                     serial: Outputs, seconds: float) -> BatchInvariance:
    """The three runs compared per request, the stress run's own first."""
    runs = {f"max_num_seqs={cfg.max_num_seqs}": ([r.token_ids for r in rollouts], [r.logprobs for r in rollouts]),
            "max_num_seqs=1": serial, f"max_num_seqs={cfg.max_num_seqs}, shuffled": shuffled}
    return BatchInvariance.of(request_ids, runs, threshold=cfg.fail_threshold, seconds=seconds)
