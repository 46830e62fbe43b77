"""What `rlcheck stress` and `rlcheck sweep` return: a `StressResult` per stress run (every
request's max |d| against the reference and its scheduler context; the failing ones and the first
wave derived from them) and a `SweepResult` of one `SweepPoint` per knob value. Plain data with its
JSON form (`to_dict`); writing and rendering them is `rlcheck.forensics.stress.report`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from rlcheck.forensics.slots import SlotContext, id_key
from rlcheck.forensics.stress.config import StressConfig


@dataclass(frozen=True)
class StressResult:
    config: StressConfig
    request_ids: tuple[str, ...]  # vLLM's request ids, arrival order
    max_abs_diff: tuple[float, ...]  # per request, vs the judge (inf: non-finite; nan: no judge)
    first_divergence: tuple[int | None, ...]  # first response token over the threshold
    contexts: tuple[SlotContext, ...]
    fault_affected: dict[str, str]  # the injected fault's own account of whom it touched
    num_blocks: int | None  # blocks in the engine's cache (state slots)
    num_steps: int | None  # engine steps traced
    trace: str  # "slot trace", or why there is none
    seconds: dict[str, float] = field(default_factory=dict)  # build, generate, score
    dump_dir: str | None = None
    guard: Any = None  # the engine guard's `GuardOutput` (summary, violations, trace) with cfg.guard
    judge: str = "reference"  # what max_abs_diff is against: "reference", "decode-prefill" or "none"
    audits: dict[str, Any] = field(default_factory=dict)  # "decode_prefill", "batch_invariance" (audits.py)
    settings: dict[str, Any] = field(default_factory=dict)  # how the engine ran (`engines.vllm_env.effective_settings`)

    @cached_property
    def guard_checks(self) -> dict[str, list[str]]:
        """Request id -> the guard checks it broke (empty without a guard)."""
        out: dict[str, list[str]] = {}
        for v in self.guard.violations if self.guard is not None else ():
            out.setdefault(v.request_id, []).append(v.check)
        return out

    @property
    def audit_failed(self) -> bool:
        """An audit found a request whose engine outputs disagree (decode vs prefill, or between runs)."""
        dp, bi = self.audits.get("decode_prefill"), self.audits.get("batch_invariance")
        return bool((dp is not None and dp.failing) or (bi is not None and bi.requests_differing))

    @property
    def threshold(self) -> float:
        return self.config.fail_threshold

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @cached_property
    def failing(self) -> list[int]:
        """Arrival indices of the failing requests."""
        return [i for i, m in enumerate(self.max_abs_diff) if m > self.threshold]

    @property
    def failing_request_ids(self) -> list[str]:
        return [self.request_ids[i] for i in self.failing]

    @property
    def failing_fraction(self) -> float:
        return len(self.failing) / max(self.num_requests, 1)

    @property
    def first_failing_index(self) -> int | None:
        return self.failing[0] if self.failing else None

    @property
    def first_wave(self) -> tuple[int, int] | None:
        """(requests that got a never-used slot, how many of them fail); None without a trace."""
        fresh = [c.arrival for c in self.contexts if c.slot_reused is False]
        if not fresh:
            return None
        return len(fresh), sum(self.max_abs_diff[i] > self.threshold for i in fresh)

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / max(sum(self.seconds.values()), 1e-9)

    def to_dict(self) -> dict[str, Any]:
        from rlcheck.core.run.journal import to_jsonable

        wave = self.first_wave
        failing = [{"request_id": self.request_ids[i], "max_abs_diff": self.max_abs_diff[i],
                    "first_divergence": self.first_divergence[i], "slot_reused": self.contexts[i].slot_reused,
                    "guard_checks": self.guard_checks.get(self.request_ids[i], []),
                    **asdict(self.contexts[i])} for i in self.failing]
        return to_jsonable({
            "num_requests": self.num_requests, "failing_request_ids": self.failing_request_ids,
            "num_failing": len(self.failing), "failing_fraction": self.failing_fraction,
            "first_failing_index": self.first_failing_index, "threshold": self.threshold,
            "first_wave": None if wave is None else {"num_requests": wave[0], "num_failing": wave[1]},
            "fault": {"name": self.config.fault, "boundary": self.config.fault_boundary,
                      **({"layer": self.config.layer} if self.config.layer is not None else {}),
                      "affected_request_ids": sorted(self.fault_affected, key=id_key)},
            "engine": {"num_blocks": self.num_blocks, "num_steps": self.num_steps, "trace": self.trace,
                       **self.settings},
            "seconds": self.seconds, "requests_per_second": self.requests_per_second,
            "config": asdict(self.config), "dump_dir": self.dump_dir, "failing": failing,
            "guard": None if self.guard is None else guard_dict(self.guard), "judge": self.judge,
            "audits": {name: audit.to_dict() for name, audit in self.audits.items()},
        })


def guard_dict(output: Any, max_violations: int = 200) -> dict[str, Any]:
    """The guard's part of stress.json (and, shorter, of the dump's meta): counts, every request id
    per broken check, the first violations."""
    s = output.summary
    return {"num_violations": s["num_violations"], "counts": s["counts"], "request_ids": s["request_ids"],
            "num_steps": s["num_steps"], "pool": s["pool"], "seconds": s["seconds"], "error": s["error"],
            "skipped_steps": s.get("skipped_steps", 0),
            "violations": [v.to_dict() for v in output.violations[:max_violations]]}


@dataclass(frozen=True)
class SweepPoint:
    knob: str
    value: int
    num_requests: int
    num_failing: int
    failing_fraction: float
    first_failing_index: int | None  # arrival index of the first failing request
    first_wave: int | None  # requests given a never-used state slot (None: no slot trace)
    first_wave_failing: int | None
    num_blocks: int | None
    seconds: float
    failing_request_ids: tuple[str, ...]
    decode_prefill_failing: int | None = None  # with the decode-prefill audit: requests over its threshold
    requests_differing: int | None = None  # with the batch-invariance audit: requests that differ between runs
    distinct_outputs: int | None = None  # ...the most distinct outputs of one request
    invariance_max_abs_diff: float | None = None  # ...max |d| before the first differing token

    @classmethod
    def of(cls, knob: str, value: int, r: StressResult) -> SweepPoint:
        wave = r.first_wave
        dp, bi = r.audits.get("decode_prefill"), r.audits.get("batch_invariance")
        return cls(knob, value, r.num_requests, len(r.failing), r.failing_fraction, r.first_failing_index,
                   None if wave is None else wave[0], None if wave is None else wave[1], r.num_blocks,
                   sum(r.seconds.values()), tuple(r.failing_request_ids),
                   None if dp is None else len(dp.failing), None if bi is None else bi.requests_differing,
                   None if bi is None else bi.distinct_outputs, None if bi is None else max(bi.max_abs_diff, default=0.0))


@dataclass(frozen=True)
class SweepResult:
    base: StressConfig
    points: tuple[SweepPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"base": asdict(self.base), "points": [asdict(p) for p in self.points]}
