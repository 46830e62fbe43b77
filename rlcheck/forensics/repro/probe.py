"""One probe of `rlcheck repro`: a case run in a fresh vLLM engine, judged by the HF reference.

    prober = Prober(model_dir, budget=150)
    probe = prober(case, "requests")   # Probe: fails, failing, max_abs_diff, outputs; cached by case
    prober.used                         # probes run so far (a cached case costs none)

The engine is built, fed and released by `rlcheck.forensics.repro.standalone.run_engine`, the very
code of the repro.py it leads to, inside `rlcheck.engines.vllm_plugin.injected(case.fault)`, the
plugin repro.py's RLCHECK_VLLM_FAULT switches on: what a probe finds, the script finds. Every probe
starts a new engine (nothing a probe leaves in the cache or the state slots reaches the next), and
the reference (`rlcheck.engines.hf.HFScorer`, float32, loaded once; a second copy with the case's
weight update) scores the batch's generated tokens. An engine that refuses the settings or fails
counts as not failing, with its error kept.
"""

from __future__ import annotations

import copy
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.forensics.repro.case import Case

ProbeProgress = Callable[[str, int, int, str], None]  # (phase, probes used, budget, what the case is now)


class BudgetSpent(Exception):
    """The probe budget is used up (the shrink keeps the smallest failing case found so far)."""


@dataclass(frozen=True)
class Probe:
    """A case's run: per batch request, the engine's tokens and logprobs and the reference's."""

    max_abs_diff: tuple[float, ...] = ()
    first_divergence: tuple[int | None, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[np.ndarray, ...] = ()
    reference: tuple[np.ndarray, ...] = ()
    threshold: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)  # how the engine ran (blocks, block size, ...)
    error: str | None = None  # the engine refused the case or failed on it
    seconds: float = 0.0

    @property
    def failing(self) -> tuple[int, ...]:
        """Batch indices over the threshold."""
        return tuple(i for i, m in enumerate(self.max_abs_diff) if m > self.threshold)

    @property
    def fails(self) -> bool:
        return self.error is None and bool(self.failing)

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff, default=0.0)

    def describe(self) -> str:
        if self.error is not None:
            return f"engine error: {self.error}"
        if self.fails:
            return f"{len(self.failing)} of {len(self.max_abs_diff)} fail (max |d| {self.worst:.3g})"
        return f"all {len(self.max_abs_diff)} within {self.threshold:g} (max |d| {self.worst:.2g})"


def error_line(exc: BaseException) -> str:
    """The line of an engine's error that says what is wrong (pydantic's header line skipped)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not re.match(r"\d+ validation errors? for ", line)] or lines
    text = lines[0].removeprefix("Assertion failed, ") if lines else type(exc).__name__
    return text.split(" [type=")[0][:300]


class Prober:
    """Runs cases (see the module docstring) within a budget of probes, caching each case's result."""

    def __init__(self, model: str | Path, budget: int, progress: ProbeProgress | None = None,
                 log: Callable[[str], None] | None = None):
        from rlcheck.forensics.replay import load_scorer

        self.scorer = load_scorer(Path(model))
        self._updated: Any = None
        self.budget, self.used, self.progress, self.log = budget, 0, progress, log
        self.cache: dict[str, Probe] = {}
        self.seconds = 0.0

    def __call__(self, case: Case, phase: str, charge: bool = True) -> Probe:
        """The case's probe (cached); `charge=False`: outside the budget (the report's own runs)."""
        key = case.key()
        if key in self.cache:
            return self.cache[key]
        if charge and self.used >= self.budget:
            raise BudgetSpent(phase)
        self.used += charge
        probe = self.run(case)
        self.cache[key] = probe
        if self.progress is not None:
            self.progress(phase, self.used, self.budget, f"{case.describe()}: {probe.describe()}")
        return probe

    def run(self, case: Case, before_batch: Any = None, after_batch: Any = None) -> Probe:
        """One fresh engine on `case`, uncached and unbudgeted (the hooks as `standalone.run_engine`'s)."""
        from rlcheck.engines.vllm_plugin import injected
        from rlcheck.forensics.repro import standalone

        t0 = time.perf_counter()
        try:
            with injected(case.fault):
                outputs, info = standalone.run_engine(case.standalone(), Path(case.model), before_batch, after_batch)
        except Exception as exc:  # noqa: BLE001 - vLLM refusing a setting, or failing on it, is a result
            if self.log is not None:
                self.log(f"probe error on {case.describe()}:\n{traceback.format_exc()}")
            self.seconds += time.perf_counter() - t0
            return Probe(error=error_line(exc), threshold=case.threshold, seconds=time.perf_counter() - t0)
        probe = self.judge(case, outputs, info, time.perf_counter() - t0)
        self.seconds += probe.seconds
        return probe

    def judge(self, case: Case, outputs: list[dict[str, Any]], info: dict[str, Any], seconds: float) -> Probe:
        from rlcheck.core.stats.sequences import request_divergence

        prompts = [list(r.prompt) for r in case.batch]
        tokens = [o["token_ids"] for o in outputs]
        engine = [np.asarray(o["logprobs"], dtype=np.float32) for o in outputs]
        reference = self.scorer_for(case).score(prompts, tokens, temperature=1.0)  # greedy logprobs: T = 1
        scores, first = request_divergence(reference, engine, case.threshold)
        return Probe(tuple(float(s) for s in scores), tuple(first), tuple(tuple(t) for t in tokens), tuple(engine),
                     tuple(reference), case.threshold, info, None, seconds)

    def scorer_for(self, case: Case) -> Any:
        """The reference on the case's weights: the model folder's, or with its weight update."""
        if not case.weight_update:
            return self.scorer
        if self._updated is None:
            from rlcheck.engines.hf import HFScorer
            from rlcheck.forensics.repro.case import UPDATE
            from rlcheck.forensics.repro.standalone import weight_update

            model = copy.deepcopy(self.scorer.model)
            model.load_state_dict(weight_update(Path(case.model), **UPDATE), strict=False)
            self._updated = HFScorer(self.scorer.cfg, model=model)
        return self._updated
