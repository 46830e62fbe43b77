"""What diagnose reads: a run's step records (metrics.jsonl), or a dump turned into one such record.

A record is `{"step", "metrics", "alarms", "offenders"}` as the Monitor logs it. A dump holds every
sequence of its step, so its record is recomputed from the sequences (statistics and signatures) and
keeps the per-sequence rows for the affected request ids; a dump of selected sequences (meta.json's
`selected`: the worst of each rank) keeps the step's logged record instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.model_types import model_type_at, recurrent_type
from rlcheck.core.run import Run
from rlcheck.core.run.context import read_context
from rlcheck.core.run.dump import META, SEQUENCES, read_dump
from rlcheck.core.run.guard_files import load_guard
from rlcheck.core.run.journal import FILENAME
from rlcheck.errors import InputError


@dataclass
class Evidence:
    source: str
    """"run" or "dump"."""
    path: Path
    records: list[dict[str, Any]]
    """Step records in step order."""
    dump_rows: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """step -> the sequences of that step's dump (request_id, max_abs_diff, first_divergence, ...)."""
    run: Run | None = None
    """The run read ("run"), for what else it holds (the guard's record, a dump's meta)."""
    dump_meta: dict[str, Any] | None = None
    """The dump's meta.json ("dump")."""

    def guard(self) -> Any:
        """The engine guard's record beside the evidence (run_dir/guard, or the dump's guard/)."""
        return self.run.guard() if self.run is not None else load_guard(self.path)

    def meta(self) -> dict[str, Any]:
        """The meta.json of the dump read ("dump"), or of the run's newest whole dump; a run that never dumped:
        its context.json as {"context": ...} (`Run.saved_context`); {} without either."""
        if self.dump_meta is not None:
            return self.dump_meta
        if self.run is None:
            return {}
        dumps = self.run.whole_dumps()
        if dumps:
            return self.run.dump_meta(dumps[-1])
        context = self.run.saved_context()
        return {"context": context} if context else {}

    def preflight(self) -> list[dict[str, Any]]:
        """The static preflight's findings as the run's context recorded them (`rlcheck.preflight`: the loop,
        TRL and verl record them at attach time, key "preflight"); [] where none were recorded."""
        ctx = self.meta().get("context")
        found = ctx.get("preflight") if isinstance(ctx, dict) else None
        return [f for f in found if isinstance(f, dict)] if isinstance(found, list) else []

    def recurrent(self) -> bool | None:
        """Whether the model has recurrent (state-space) layers: from the context's `model_type`, else the
        model directory's config.json where it is on this machine; None where neither says (an older dump
        of a model not here), which the state rules read as today: a state cause is possible."""
        return recurrent_type(self.model_type())

    def model_type(self) -> str | None:
        """The model's HF `model_type`: the context's, else its config.json's; None: unknown."""
        ctx = read_context(self.meta())
        return ctx.model_type or (model_type_at(ctx.model) if ctx.model else None)


def load_evidence(path: Run | str | Path) -> Evidence:
    """A run (a `Run`, or a directory holding metrics.jsonl; its dumps are read too, through the Run)
    or one dump directory."""
    if isinstance(path, Run) or (Path(path) / FILENAME).is_file():
        run = Run.open(path)
        ev = Evidence("run", run.path, sorted(run.records(), key=lambda r: r["step"]), run=run)
        for d in run.whole_dumps():
            rows, meta = run.dump(d)
            ev.dump_rows[int(meta["step"])] = rows
        return ev
    path = Path(path)
    if (path / SEQUENCES).is_file():
        rows, meta = read_dump(path)
        return Evidence("dump", path, [dump_record(rows, meta)], {int(meta["step"]): rows}, dump_meta=meta)
    raise InputError(
        f"{path} is neither a run directory (with {FILENAME}) nor a dump (with {SEQUENCES} and {META})"
    )


def dump_record(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The step record of a dump: statistics and signature alarms recomputed from its sequences."""
    from rlcheck.core.batch import StepBatch
    from rlcheck.core.detect.signature import SignatureDetector
    from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
    from rlcheck.core.prompt_ids import alarms_of as prompt_alarms_of
    from rlcheck.core.stats import StatsConfig, compute

    def column(name: str):
        values = [row.get(name) for row in rows]
        return None if any(v is None for v in values) else [np.asarray(v) for v in values]

    batch = StepBatch.from_ragged(
        logp_rollout=[row["logp_rollout"] for row in rows],
        logp_train=[row["logp_train"] for row in rows],
        request_ids=[row["request_id"] for row in rows],
        mask=column("mask"),
        tokens=column("response_tokens"),
        tokens_train=column("tokens_train"),
        prompt_tokens=column("prompt_tokens"),
        turns=column("turn_index"),  # a multi-turn dump: its per-turn statistics recomputed too
    )
    metrics, offenders = compute(batch, StatsConfig())
    step = int(meta.get("step", 0))
    if meta.get("selected"):  # the worst sequences of a step (a halt over several ranks): its own numbers
        return {"step": step, "metrics": meta.get("metrics") or metrics, "alarms": list(meta.get("alarms", [])),
                "offenders": list(meta.get("offenders") or [o.to_dict() for o in offenders])}
    alarms = [a.to_dict() for a in SignatureDetector().update(step, metrics)]
    prompts, theirs = column("prompt_tokens"), column(PROMPT_TOKENS_TRAIN)
    if prompts is not None and theirs is not None:  # the two sides' prompt ids (`rlcheck.core.prompt_ids`)
        alarms += [a.to_dict() for a in prompt_alarms_of(step, prompts, theirs, batch.request_ids)]
    # the run's other alarms of this step (periodic, drift, ...) need its history, the cross-turn invariants the
    # engine's per-call prompts (not dumped): take them as logged
    alarms += [a for a in meta.get("alarms", []) if a.get("kind") != "signature"
               or str((a.get("details") or {}).get("signature", "")).startswith("turn_")]
    return {"step": step, "metrics": metrics, "alarms": alarms, "offenders": [o.to_dict() for o in offenders]}
