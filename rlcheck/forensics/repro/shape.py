"""The knob table of `rlcheck repro`: the minimal case with one thing changed at a time, and whether
the failure appears or vanishes: the "shape" the engineers of the design notes' background mapped by
hand (memory pressure brought the stale state out; less memory hid the wrapped index).

    rows = knob_table(prober, case, probe)     # Row(knob, setting, status, detail), the case's own first

One row per value tried: each knob of `KNOBS` at the values of its ladder other than the case's own
(and vLLM's default, where the case changes the knob), KV-cache blocks at 1/2 to 1/16 of the case's,
the arrival: the batch in reversed order, the earlier requests served with the batch instead of
before it; and for a fault rlcheck injected, the case without it (it must vanish: the shrink kept the
fault's failure, not another one). Rows run eager when the case runs compiled but also fails eager (a compiled engine costs
tens of seconds on CPU); the table says so. A row the budget leaves out says "not tried".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlcheck.forensics.repro.case import KNOBS, Case, Knob
from rlcheck.forensics.repro.probe import BudgetSpent, Probe, Prober

APPEARS, VANISHES, REFUSED, NOT_TRIED = "appears", "vanishes", "engine error", "not tried (budget)"


@dataclass(frozen=True)
class Row:
    knob: str  # what is changed, as the report names it
    setting: str  # its value in this row
    status: str  # APPEARS, VANISHES, REFUSED or NOT_TRIED
    detail: str  # the probe's verdict in words
    own: bool = False  # the case as it is

    def to_dict(self) -> dict[str, Any]:
        return {"knob": self.knob, "setting": self.setting, "status": self.status, "detail": self.detail, "own": self.own}


def knob_table(prober: Prober, case: Case, probe: Probe, compiled: bool = True) -> tuple[tuple[Row, ...], str | None]:
    """(rows, a note on how they ran) for the minimal `case`, which failed with `probe`; `compiled`:
    False leaves out the compiled engine (the eager row)."""
    rows = [Row("the case", _settings(case), APPEARS, probe.describe(), own=True)]
    base, note = _measured_on(prober, case)
    for knob in KNOBS if compiled else [k for k in KNOBS if k.name != "enforce_eager"]:
        on = case if knob.name == "enforce_eager" else base
        for setting, candidate in _variants(knob, on, probe.info):
            rows.append(_row(prober, knob.label, setting, candidate))
            if knob.name == "enable_chunked_prefill" and "align" in rows[-1].detail:  # Mamba's align mode needs it
                rows.append(_row(prober, knob.label, f"{setting}, enable_prefix_caching=False",
                                 candidate.with_knob("enable_prefix_caching", False)))
    for what, setting, candidate in _others(base):
        rows.append(_row(prober, what, setting, candidate))
    return tuple(rows), note


def _measured_on(prober: Prober, case: Case) -> tuple[Case, str | None]:
    """The case the rows change: the case, or its eager twin when it runs compiled and that fails too."""
    if case.knob_dict.get("enforce_eager"):
        return case, None
    eager = case.with_knob("enforce_eager", True)
    try:
        if prober(eager, "knob table").fails:
            return eager, "rows measured with enforce_eager=True (the case also fails eager; compiling costs tens of seconds an engine)"
    except BudgetSpent:
        pass
    return case, None


def _row(prober: Prober, knob: str, setting: str, candidate: Case) -> Row:
    try:
        probe = prober(candidate, "knob table")
    except BudgetSpent:
        return Row(knob, setting, NOT_TRIED, "")
    status = REFUSED if probe.error is not None else APPEARS if probe.fails else VANISHES
    return Row(knob, setting, status, probe.describe())


def _variants(knob: Knob, case: Case, info: dict[str, Any]) -> list[tuple[str, Case]]:
    """(setting in words, the case with it) for each value of `knob` to try."""
    own = case.knob_dict.get(knob.name, _default(knob.name, case, info))
    out = [] if knob.name not in case.knob_dict else [(f"vLLM's default ({_default(knob.name, case, info)})",
                                                      case.without_knob(knob.name))]
    for value in _ladder(knob, case, info):
        if value != own:
            out.append((f"{knob.name}={value}", case.with_knob(knob.name, value)))
    return out


def _ladder(knob: Knob, case: Case, info: dict[str, Any]) -> tuple[Any, ...]:
    if knob.name == "num_gpu_blocks_override":
        blocks = int(info.get("num_blocks") or 0)
        return tuple(dict.fromkeys(blocks // k for k in (2, 4, 8, 16) if blocks // k >= 1))
    if knob.name == "max_num_seqs":  # past the number of requests every value runs them all at once
        return tuple(v for v in knob.ladder if v < len(case.requests)) or (1,)
    return knob.ladder


def _default(name: str, case: Case, info: dict[str, Any]) -> Any:
    """What vLLM ran with when the case left `name` alone (from the probe's engine), "?" if unknown."""
    if name == "dtype":
        return case.dtype
    return info.get({"num_gpu_blocks_override": "num_blocks"}.get(name, name), "?")


def _others(case: Case) -> list[tuple[str, str, Case]]:
    """Rows beside the knobs: the arrival order, and an injected fault switched off."""
    out = []
    if len(case.batch) > 1:
        out.append(("arrival", "the batch in reversed order", replace(case, batch=case.batch[::-1])))
    if case.history:
        out.append(("arrival", "the earlier requests served with the batch, not before it",
                    replace(case, history=(), batch=case.history + case.batch)))
    if case.fault:
        out.append(("injected fault", f"RLCHECK_VLLM_FAULT unset (no {case.fault})", replace(case, fault=None)))
    return out


def _settings(case: Case) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.knobs) or "vLLM's defaults"


def reversed_outputs(probe: Probe) -> Probe:
    """A probe of the reversed batch, put back in the batch's order (batch invariance compares runs)."""
    return replace(probe, max_abs_diff=probe.max_abs_diff[::-1], first_divergence=probe.first_divergence[::-1],
                   tokens=probe.tokens[::-1], logprobs=probe.logprobs[::-1], reference=probe.reference[::-1])
