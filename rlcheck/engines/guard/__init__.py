"""The engine guard: request identity and lifecycle invariants inside vLLM's forward pass (vllm 0.32,
in-process engine, opt-in).

    engine = VLLMEngine(VLLMConfig(model=..., guard=GuardConfig(run_dir="runs/exp1")))
    rollouts = engine.generate(prompts, step=3)
    engine.guard.violations          # [Violation(check, step, request_id, slot, message, ...)]
    engine.take_guard_violations()   # the new ones since the last call, as dicts (for the loop's alarms)
    guard = install_guard(llm, GuardConfig(policy="raise"))   # any in-process vllm.LLM

Logprob comparison sees the symptom; the guard sees the cause, at the step where it happens. For
every forward step it records which requests ran, each one's phase (prefill, chunked prefill,
decode), its computed-token count, and the state slot and block ids its Mamba and attention layers
address, keyed by the id `LLM.generate` reports; a ring buffer keeps the last `capacity` steps. It
checks five invariants on each step (`rlcheck.engines.guard.checks`: (i) a request with no computed
tokens runs as prefill from zeros, (ii) no two live requests share a state slot, (iii) ids within the
pool, (iv) slot x stride fits a 32-bit offset with room to spare, (v) a freed slot is reinitialised
before it is read) and applies each check's policy: record, warn (a RuntimeWarning, the first
MAX_WARNINGS) or raise (`rlcheck.errors.GuardViolation`, before the step's forward runs; close the
engine afterwards, and drop a kept exception's `__traceback__`: its frames hold the in-process engine). `RLCHECK_BREAK_ON=<id>[,<id>...]` (or `GuardConfig.break_on`) writes a JSON
snapshot of the scheduler output and the attention / Mamba metadata each step that request is
scheduled, and with `RLCHECK_BREAK_PDB=1` (`break_pdb`) stops in pdb there. Files: `rlcheck.core.run.guard_files`.

A guard that fails itself (its reader, checker or snapshot writer raises, or its first traced step does
not show the work vLLM scheduled: `check_real_work`) stops guarding but never the engine: the error and
its traceback go into the summary at once and into `take_report`, whose first report after it the loop
turns into an alarm (`guard_alarms`: warn, signature "engine_guard_dead"; `guard/alive` 0 from then on).
Steps it cannot trace (micro-batched metadata, a list of dicts) are counted (`skipped_steps`).

Where it hooks: two instance attributes of the engine's model runner (no class is patched):
`execute_model` (to hold the step's SchedulerOutput) and `_model_forward`, which vLLM calls inside
`set_forward_context` (gpu_model_runner.py:4189-4213), so the guard reads the metadata the kernels
are about to read. An injected fault (`rlcheck.engines.vllm_faults`) rewrites that metadata earlier,
in `_build_attention_metadata` (:4142); the two compose in either order of installation and the
guard sees the fault's rewrite, as the kernels do. What it reads: `rlcheck.engines.guard.reader`.
Its settings, `GuardConfig`, are `rlcheck.engines.guard.config`; its alarms, `violations_to_alarms`,
`rlcheck.engines.guard.alarms` (both re-exported here).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlcheck.core.run import guard_files as gio
from rlcheck.core.run.guard_record import CHECKS, INVARIANT, StepRecord, Violation
from rlcheck.engines.guard.alarms import (
    ALIVE_METRIC,
    DEAD_SIGNATURE,
    GUARD_METRIC,
    SIGNATURE,
    SKIPPED_METRIC,
    dead_guard_alarm,
    guard_alarms,
    violations_to_alarms,
)
from rlcheck.engines.guard.checks import InvariantChecker
from rlcheck.engines.guard.config import BREAK_ENV, BREAK_PDB_ENV, POLICIES, GuardConfig
from rlcheck.errors import ConfigError, GuardViolation

__all__ = ["ALIVE_METRIC", "BREAK_ENV", "BREAK_PDB_ENV", "CHECKS", "DEAD_SIGNATURE", "GUARD_METRIC", "INVARIANT",
           "MAX_WARNINGS", "POLICIES", "SIGNATURE", "SKIPPED_METRIC", "Guard", "GuardConfig", "StepRecord", "Violation",
           "dead_guard_alarm", "guard_alarms", "install_guard", "violations_to_alarms"]

MAX_WARNINGS = 20


class Guard:
    """The guard on one engine's model runner; see the module docstring."""

    def __init__(self, runner: Any, cfg: GuardConfig):
        from rlcheck.engines.guard.reader import StepReader, layout, pool_info

        self.cfg, self.runner = cfg, runner
        self.pool = pool_info(runner)
        self.reader = StepReader(runner, layout(runner))
        self.checker = InvariantChecker(self.pool, cfg.offset_limit, cfg.offset_margin)
        self.trace: deque[StepRecord] = deque(maxlen=cfg.capacity)
        self.violations: list[Violation] = []
        self.counts: Counter[str] = Counter()  # every occurrence, per check
        self.step, self.call_step, self.seconds, self.dropped = 0, None, 0.0, 0
        self.rollout_prefix: str | None = None  # VLLMEngine's engine_id: violations get the rollout's id
        self.error: str | None = None  # set when the guard died (its reader or checker raised): it guards no more
        self.error_trace: str | None = None
        self.skipped = 0  # forward steps with work scheduled that the guard could not trace
        self._error_taken = False
        self.snapshots: list[Path] = []
        self._seen: set[tuple[str, str]] = set()
        self._taken = self._warned = 0
        self._snap_count: Counter[str] = Counter()
        self._sched: Any = None
        self._file = None
        self.dir = Path(cfg.run_dir) / gio.GUARD_DIR if cfg.run_dir else None
        self._execute, self._forward = runner.execute_model, runner._model_forward
        runner.execute_model, runner._model_forward = self._execute_model, self._model_forward

    # ---- public --------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.runner.__dict__.get("_model_forward") == self._model_forward

    def begin_call(self, step: int | None) -> None:
        """Tag the following forward steps with the caller's step (`VLLMEngine.generate` does)."""
        self.call_step = step

    def take_violations(self) -> list[Violation]:
        """The violations kept since the previous call."""
        new, self._taken = self.violations[self._taken:], len(self.violations)
        return new

    def take_report(self) -> dict[str, Any]:
        """What the loop asks after each generation: the violations since the previous call, the error
        that stopped the guard (once: None again after it was taken; `alive` stays False), the steps
        traced and the steps skipped so far."""
        error = None if self._error_taken else self.error
        self._error_taken = self.error is not None
        return {"violations": self.take_violations(), "alive": self.error is None, "error": error,
                "error_trace": self.error_trace if error else None, "steps": self.step, "skipped_steps": self.skipped}

    def summary(self) -> dict[str, Any]:
        by_check: dict[str, list[str]] = {}
        for v in self.violations:
            by_check.setdefault(v.check, []).append(v.request_id)
        return {
            "num_steps": self.step, "num_violations": sum(self.counts.values()), "counts": dict(self.counts),
            "request_ids": by_check, "num_kept": len(self.violations), "dropped": self.dropped,
            "first": {c: next(v.to_dict() for v in self.violations if v.check == c) for c in by_check},
            "checks": CHECKS, "policies": {c: self.cfg.policy_for(c) for c in CHECKS},
            "pool": self.pool.to_dict(self.cfg.offset_limit, self.cfg.offset_margin),
            "layout": {"mamba_groups": [g for g, _, _ in self.reader.layout.mamba],
                       "attention_groups": list(self.reader.layout.attention), "mamba_cache_mode": self.reader.layout.mode},
            "trace_steps": len(self.trace), "capacity": self.cfg.capacity, "seconds": self.seconds,
            "snapshots": [str(p) for p in self.snapshots], "error": self.error, "error_trace": self.error_trace,
            "skipped_steps": self.skipped,
        }

    def output(self) -> gio.GuardOutput:
        return gio.GuardOutput(self.summary(), tuple(self.violations), tuple(self.trace))

    def write(self, directory: str | os.PathLike) -> Path:
        """Write summary, violations and trace into DIR/guard (a dump, a stress run); returns it."""
        return self.output().write(directory)

    def flush(self) -> None:
        """Bring run_dir/guard up to date (summary.json, trace.jsonl; violations.jsonl is always)."""
        if self.dir is not None:
            gio.write_summary(self.dir, self.summary())
            gio.write_trace(self.dir, list(self.trace))

    def remove(self) -> None:
        """Unhook the runner (idempotent); the record stays readable."""
        for name in ("execute_model", "_model_forward"):
            self.runner.__dict__.pop(name, None)

    def close(self) -> None:
        """Flush and unhook."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        self.remove()

    # ---- the hooks -----------------------------------------------------------------------------

    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._sched = scheduler_output
        try:
            return self._execute(scheduler_output, *args, **kwargs)
        finally:
            self._sched = None

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        sched, self._sched = self._sched, None  # once per execute_model; dummy runs have none
        if sched is not None and self.error is None:
            self._on_step(sched)
        return self._forward(*args, **kwargs)

    def _on_step(self, sched: Any) -> None:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or not self.runner.input_batch.num_reqs:
            self.skipped += 1  # micro-batched metadata (a list of dicts), or no request: not traced, counted
            return
        t0 = time.perf_counter()
        self.step += 1
        try:
            rec = self.reader.read(self.step, sched, metadata, self.call_step)
            if self.step == 1:
                check_real_work(rec, sched)
            found = self.checker.check(rec)
            if self.cfg.break_on:
                self._break(rec, sched, metadata, found)
        except Exception as exc:  # noqa: BLE001 - a guard bug must not take the engine down: stop guarding, say so
            self._die(exc)
            return
        self.trace.append(rec)
        raising = self._admit(found)
        self.seconds += time.perf_counter() - t0
        if raising:
            self.flush()
            raise GuardViolation(raising, None if self.dir is None else str(self.dir))

    def _die(self, exc: Exception) -> None:
        """Stop guarding for this engine's life, keeping why: a warning now, the error in the summary (on
        disk at once) and in `take_report` (the loop's alarm: a dead guard never reads as a clean one)."""
        import traceback

        where = "" if self.call_step is None else f" (caller's step {self.call_step})"
        self.error = f"engine step {self.step}{where}: {type(exc).__name__}: {exc}"
        self.error_trace = "".join(traceback.format_exception(exc))[-4000:]
        warnings.warn(f"rlcheck engine guard stopped: {self.error}", RuntimeWarning, stacklevel=3)
        self.flush()

    def _admit(self, found: list[Violation]) -> list[Violation]:
        """Count, keep (the first per request and check), write, warn; the ones to raise."""
        raising = []
        for v in found:
            self.counts[v.check] += 1
            key = (v.check, v.request_id)
            if key in self._seen:
                continue
            if len(self.violations) >= self.cfg.max_violations:
                self.dropped += 1
                continue
            self._seen.add(key)
            if self.rollout_prefix is not None and v.call_step is not None:
                v = replace(v, rollout_request_id=f"{self.rollout_prefix}/s{v.call_step}/{v.request_id}")
            self.violations.append(v)
            self._append(v)
            policy = self.cfg.policy_for(v.check)
            if policy == "warn":
                self._warn(v)
            elif policy == "raise":
                raising.append(v)
        return raising

    def _append(self, v: Violation) -> None:
        if self.dir is None:
            return
        if self._file is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.dir / gio.VIOLATIONS, "a", encoding="utf-8")  # noqa: SIM115 - held open
        self._file.write(gio.violation_line(v))
        self._file.flush()

    def _warn(self, v: Violation) -> None:
        self._warned += 1
        if self._warned <= MAX_WARNINGS:
            more = "; further violations are recorded without a warning" if self._warned == MAX_WARNINGS else ""
            warnings.warn(f"rlcheck engine guard {v.invariant} {v.check}: {v.message}{more}", RuntimeWarning,
                          stacklevel=2)

    def _break(self, rec: StepRecord, scheduler_output: Any, metadata: dict[str, Any], found: list[Violation]) -> None:
        """A JSON snapshot for each break request of the step; then pdb if asked (its locals:
        scheduler_output, metadata, rec, path)."""
        from rlcheck.engines.guard.reader import write_snapshot

        root = (self.dir if self.dir is not None else Path("runs") / "guard-break") / gio.BREAK_DIR
        pool = self.pool.to_dict(self.cfg.offset_limit, self.cfg.offset_margin)
        for i, rid in enumerate(rec.request_ids):
            if rid not in self.cfg.break_on or self._snap_count[rid] >= self.cfg.max_snapshots:
                continue
            self._snap_count[rid] += 1
            path = root / gio.safe_name(rid) / f"step_{rec.step:06d}.json"
            write_snapshot(path, rec, i, scheduler_output, metadata, found, pool)
            self.snapshots.append(path)
            print(f"rlcheck engine guard: request {rid} scheduled at step {rec.step}: snapshot {path}", file=sys.stderr)
            if self.cfg.break_pdb:
                import pdb

                pdb.set_trace()


def check_real_work(rec: StepRecord, sched: Any) -> None:
    """The guard's first traced step must show the work vLLM scheduled: at least one request, and the
    batch's scheduled tokens adding up to the scheduler's total. Otherwise the reader is out of step
    with this vLLM and every later record would be empty: a RuntimeError, which stops the guard."""
    total = int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)
    if rec.num_reqs == 0 or int(rec.scheduled.sum()) != total:
        raise RuntimeError(f"the guard's first step read {rec.num_reqs} request(s) and {int(rec.scheduled.sum())} "
                           f"scheduled tokens, the scheduler scheduled {total}: its reader does not understand "
                           "this vLLM's batch")


def install_guard(engine: Any, cfg: GuardConfig | None = None) -> Guard:
    """Guard `engine` (a `VLLMEngine` or an in-process `vllm.LLM`) until `guard.close()`; the config's
    break settings are merged with RLCHECK_BREAK_ON / RLCHECK_BREAK_PDB. Refused like a fault
    (`vllm_faults._model_runner`): other vLLM versions, multiprocess engines, TP > 1, full CUDA graphs."""
    from rlcheck.engines.vllm_faults import _model_runner

    runner = _model_runner(engine)
    if "_model_forward" in runner.__dict__:
        raise ConfigError("this engine already has a guard; close it first")
    return Guard(runner, (cfg or GuardConfig()).with_env())
