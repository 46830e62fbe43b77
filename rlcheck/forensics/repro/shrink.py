"""The shrink of `rlcheck repro`: a failing case made small, deterministically, probe by probe.

    shrunk = Shrinker(prober, axes=SHRINK_AXES).run(case, first_probe)
    shrunk.case, shrunk.minimal, shrunk.steps     # the case, 1-minimal or not (budget), what each step took away

In order, each phase on an axis of `axes` (a probe is a fresh engine, `rlcheck.forensics.repro.probe`),
the cheap and large reductions first (a probe costs what its requests and tokens cost):
1. requests: the batch cut after its first failing request (what arrived later did not cause it);
2. max_tokens: every request's max_tokens cut down by bisection (a state fault shows in the first
   tokens; every later probe is shorter for it);
3. requests: delta debugging (Zeller's ddmin) over every request, the earlier ones (history) and the
   batch's; the batch never empties;
4. knobs, concurrency: one request at a time (max_num_seqs 1), kept when it still fails, then ddmin
   again (a failure that needs a slot someone held before then needs two requests, not a crowd);
5. prompt_lengths: every prompt cut to its shortest failing length (keeping its first tokens);
6. passes of one-step reductions until a whole pass removes nothing: drop one request, the weight
   update, one knob change (back to vLLM's default), one prompt token or one max_token of one request
   (then bisect that request's length down); then eager (`SLOW_KNOBS`: without it vLLM compiles, tens
   of seconds an engine on CPU) back to vLLM's compiled default, and if it still fails the passes
   again, compiled. The last pass shows the case 1-minimal on the axes searched: any one such
   reduction makes the failure vanish. `compiled=False` leaves eager as it is (and says so).
A spent budget stops it where it is: the case still fails, but is not shown 1-minimal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from rlcheck.forensics.repro.case import KNOB_NAMES, SLOW_KNOBS, Case, Request
from rlcheck.forensics.repro.probe import BudgetSpent, Probe, Prober

SHRINK_AXES = ("requests", "prompt_lengths", "max_tokens", "weight_update", "knobs")
"""What the shrink may take away (each reduction tested; the result 1-minimal on these)."""
NOT_SEARCHED = (
    "the token ids themselves (prompts are cut to their first tokens, never rewritten)",
    "max_model_len, the seed and the cache budget in bytes (kept as recorded; the knob table tries KV-cache blocks)",
    "the weights (the model folder's; a run's synced weights are not recorded)",
    "sampling beyond greedy (temperature 0, EOS ignored: every request generates exactly max_tokens)",
    "tensor and pipeline parallelism, speculative decoding, async scheduling (one in-process CPU worker)",
)


@dataclass(frozen=True)
class Step:
    phase: str
    what: str  # the reduction, in words
    after: str  # the case after it (`Case.describe`)
    probes: int  # probes used when it was taken


@dataclass(frozen=True)
class Shrunk:
    case: Case
    probe: Probe  # the final case's
    steps: tuple[Step, ...]
    minimal: bool  # the last pass of one-step reductions ran whole: 1-minimal on `axes`
    stopped: str | None  # the phase the budget ran out in
    axes: tuple[str, ...]
    compiled: bool = True  # vLLM's compiled default was tried (the eager knob searched)


class Shrinker:
    def __init__(self, prober: Prober, axes: tuple[str, ...] = SHRINK_AXES, compiled: bool = True):
        self.prober, self.axes, self.compiled = prober, axes, compiled
        self.steps: list[Step] = []

    def run(self, case: Case, probe: Probe) -> Shrunk:
        """Shrink `case`, which failed with `probe` (see the module docstring)."""
        self.best, self.best_probe, stopped, minimal = case, probe, None, False
        try:
            if "requests" in self.axes:
                self._cut_after_first_failing()
            if "max_tokens" in self.axes:
                self._bisect_all("max_tokens")
            if "requests" in self.axes:
                self._ddmin()
            if ("knobs" in self.axes and len(self.best.requests) > 1 and self.best.knob_dict.get("max_num_seqs") != 1
                    and self._try(self.best.with_knob("max_num_seqs", 1), "concurrency", "one request at a time (max_num_seqs 1)")
                    and "requests" in self.axes):
                self._ddmin()
            if "prompt_lengths" in self.axes:
                self._bisect_all("prompt_lengths")
            self._passes()
            minimal = True
        except BudgetSpent as spent:
            stopped = str(spent.args[0]) if spent.args else "?"
        return Shrunk(self.best, self.best_probe, tuple(self.steps), minimal, stopped, self.axes, self.compiled)

    # ---- the predicate -------------------------------------------------------------------------

    def _try(self, candidate: Case, phase: str, what: str) -> bool:
        """Probe `candidate`; when it fails too, it becomes the case."""
        if not candidate.batch or candidate.key() == self.best.key():
            return False
        probe = self.prober(candidate, phase)
        if probe.fails:
            self.best, self.best_probe = candidate, probe
            self.steps.append(Step(phase, what, candidate.describe(), self.prober.used))
        return probe.fails

    # ---- requests ------------------------------------------------------------------------------

    def _subset(self, keep: list[int]) -> Case:
        """The case with only the requests at `keep` (indices into `requests`: history, then batch)."""
        h = len(self.best.history)
        chosen = sorted(set(keep))
        return self.best.with_requests(tuple(self.best.history[i] for i in chosen if i < h),
                                       tuple(self.best.batch[i - h] for i in chosen if i >= h))

    def _cut_after_first_failing(self) -> None:
        first = min(self.best_probe.failing, default=None)
        h, n = len(self.best.history), len(self.best.batch)
        if first is not None and first + 1 < n:
            self._try(self._subset(list(range(h + first + 1))), "requests",
                      f"the batch cut after its first failing request ({n} -> {first + 1})")

    def _ddmin(self) -> None:
        """Zeller's ddmin over every request: subsets first, then complements, granularity doubling."""
        n = 2
        while (size := len(self.best.requests)) >= 2:
            n = min(n, size)
            chunks = [list(range(i * size // n, (i + 1) * size // n)) for i in range(n)]
            reduced = self._reduce(size, chunks, n)
            if reduced is not None:
                n = reduced
            elif n >= size:
                return
            else:
                n = min(2 * n, size)

    def _reduce(self, size: int, chunks: list[list[int]], n: int) -> int | None:
        """The granularity to go on with after a subset or complement that still fails; None if none does."""
        for chunk in chunks:
            if self._try(self._subset(chunk), "requests", f"requests {size} -> {len(chunk)} (ddmin: a subset)"):
                return 2
        for chunk in chunks if n > 2 else []:
            rest = [i for i in range(size) if i not in set(chunk)]
            if self._try(self._subset(rest), "requests", f"requests {size} -> {len(rest)} (ddmin: a complement)"):
                return max(n - 1, 2)
        return None

    # ---- lengths -------------------------------------------------------------------------------

    def _bisect_all(self, what: str) -> None:
        """The smallest cap on every request's prompt length (or max_tokens) that still fails."""
        longest = max(_length(r, what) for r in self.best.requests)
        self._bisect(lambda case, cap: _capped(case, what, cap), longest, what, f"every {_word(what)} cut to")

    def _bisect(self, make: Callable[[Case, int], Case], current: int, phase: str, words: str) -> None:
        """Bisect [1, current) for the smallest value v whose case `make(start, v)` still fails (the
        start, the case now, fails at `current`); that case becomes the case, even if the budget runs
        out on the way."""
        start, lo, hi, found = self.best, 1, current, None
        try:
            while lo < hi:
                mid = (lo + hi) // 2
                candidate = make(start, mid)
                probe = self.prober(candidate, phase) if candidate.key() != start.key() else None
                if probe is not None and probe.fails:
                    hi, found = mid, (candidate, probe)
                else:
                    lo = mid + 1
        finally:
            if found is not None:
                self.best, self.best_probe = found
                self.steps.append(Step(phase, f"{words} {hi}", self.best.describe(), self.prober.used))

    # ---- one-step reductions, until a whole pass takes nothing ---------------------------------

    def _passes(self) -> None:
        """One-step passes to a fixpoint; then the slow knobs, and the passes again when one went."""
        while True:
            self._fixpoint()
            slow = [k for k in SLOW_KNOBS if k in self.best.knob_dict] if "knobs" in self.axes and self.compiled else []
            if not any(self._try(self.best.without_knob(k), "knobs", f"{k} back to vLLM's default") for k in slow):
                return

    def _fixpoint(self) -> None:
        while True:
            taken = False
            for phase, what, make, request in list(self._one_step()):
                candidate = make()
                if candidate is not None and self._try(candidate, phase, what):
                    taken = True
                    if request is not None:  # a request one token shorter still fails: bisect it further
                        shorter = _set_length(request, phase, _length(request, phase) - 1)
                        self._bisect(lambda case, v, r=shorter, p=phase: _replaced(case, r, _set_length(r, p, v)),
                                     _length(shorter, phase), phase, f"{_word(phase)} of {request.origin} cut to")
            if not taken:
                return

    def _one_step(self) -> Iterator[tuple[str, str, Callable[[], Case | None], Request | None]]:
        """Every one-step reduction of the case; each made on the case as it is when it is tried."""
        if "requests" in self.axes:
            for r in self.best.requests:
                yield "requests", f"request {r.origin} removed", lambda r=r: self._without(r), None
        if "weight_update" in self.axes and self.best.weight_update:
            yield "weight_update", "the weight update removed", lambda: replace(self.best, weight_update=False), None
        if "knobs" in self.axes:
            for name in sorted((k for k in self.best.knob_dict if k not in SLOW_KNOBS), key=KNOB_NAMES.index):
                yield "knobs", f"{name} back to vLLM's default", lambda name=name: self.best.without_knob(name), None
        for what in ("prompt_lengths", "max_tokens"):
            if what in self.axes:
                for r in self.best.requests:
                    yield what, f"{_word(what)} of {r.origin} one shorter", lambda r=r, w=what: self._shorter(r, w), r

    def _without(self, request: Request) -> Case | None:
        if request not in self.best.requests:
            return None
        return self.best.with_requests(tuple(r for r in self.best.history if r != request),
                                       tuple(r for r in self.best.batch if r != request))

    def _shorter(self, request: Request, what: str) -> Case | None:
        if request not in self.best.requests or _length(request, what) <= 1:
            return None
        return _replaced(self.best, request, _set_length(request, what, _length(request, what) - 1))


# ---- lengths of requests -----------------------------------------------------------------------------


def _word(what: str) -> str:
    return "prompt length" if what == "prompt_lengths" else "max_tokens"


def _length(request: Request, what: str) -> int:
    return len(request.prompt) if what == "prompt_lengths" else request.max_tokens


def _set_length(request: Request, what: str, value: int) -> Request:
    if what == "prompt_lengths":
        return replace(request, prompt=request.prompt[:value])
    return replace(request, max_tokens=value)


def _capped(case: Case, what: str, cap: int) -> Case:
    cut = {r: _set_length(r, what, min(_length(r, what), cap)) for r in case.requests}
    return case.with_requests(tuple(cut[r] for r in case.history), tuple(cut[r] for r in case.batch))


def _replaced(case: Case, old: Request, new: Request) -> Case:
    return case.with_requests(tuple(new if r == old else r for r in case.history),
                              tuple(new if r == old else r for r in case.batch))
