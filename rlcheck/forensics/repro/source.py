"""What `rlcheck repro` starts from: a run directory (its newest dump: the halt's), a dump, or a
`rlcheck stress --out` directory, read into the recorded case (`Source.case`).

    source = read_source("runs/demo-x")      # or runs/demo-x/dumps/step_000004, or runs/stress-y
    source.case            # Case: the step's requests, the engine's settings, its fault; None: nothing to do
    source.nothing         # why there is nothing to reproduce (a run that did not halt, a clean stress run)
    source.recorded        # how the case was built from the record, in words

A run's dump holds the step's prompts and responses but not the run's synced weights, nor the steps
before it: the case serves the step's requests once before them (the engine had served earlier steps,
which left their state behind: `Case.history`) when the step is not the first, and syncs a seeded
update of the model folder's weights before the batch (`Case.weight_update`) when the rollouts carry
a weight version past 0. Each request generates as many tokens as its response held, greedily.
A stress output is its one `LLM.generate`: every prompt in arrival order, its settings and its fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcheck.core.run import Run
from rlcheck.core.run.dump import META, SEQUENCES
from rlcheck.errors import InputError
from rlcheck.forensics.replay import DumpSequences, load_sequences, resolve_model
from rlcheck.forensics.repro.case import Case, Request

DEFAULT_MAX_MODEL_LEN = 1024
"""`VLLMConfig.max_model_len`: a run's dump does not record it (its engines are rlcheck's)."""


@dataclass(frozen=True)
class Source:
    kind: str  # "run", "dump" or "stress"
    path: Path  # what was passed
    dump: Path | None = None  # the dump the case comes from
    run_dir: Path | None = None  # the run around it (diagnose's evidence), None for stress or a lone dump
    case: Case | None = None
    nothing: str | None = None  # why there is nothing to reproduce
    fault: str | None = None  # the run's injected engine fault, as RLCHECK_VLLM_FAULT spells it
    fault_note: str | None = None  # an injected fault of the run that repro cannot re-create
    recorded: tuple[str, ...] = ()
    sequences: DumpSequences | None = None  # the dump's sequences (which side the reference agrees with)
    meta: dict[str, Any] = field(default_factory=dict)


def read_source(path: str | Path, model: str | Path | None = None) -> Source:
    """The recorded case of a run directory, a dump or a stress output (see the module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path} is not a directory: pass a run directory, a dump (RUN/dumps/step_N) "
                         "or a `rlcheck stress --out` directory")
    if (path / SEQUENCES).is_file() or (path / META).is_file():
        return _from_dump(path, model, kind="stress" if (path / "stress.json").is_file() else "dump")
    if (path / "stress.json").is_file():  # a stress run that wrote no dump (no reference)
        return Source("stress", path, nothing=f"{path} holds no dump (stress ran with --no-reference): nothing "
                      "was compared with the reference; run `rlcheck stress` with the reference")
    run = Run.open(path)
    dumps = run.whole_dumps()
    if not dumps:
        records = run.records()
        alarms = sum(len(r.get("alarms") or ()) for r in records)
        what = f"{len(records)} steps, {alarms} alarm(s)" if records else "no step recorded"
        return Source("run", path, run_dir=path, nothing=f"{path} has no dump ({what}): the run did not halt "
                      "on a mismatch, so there is no failing step to reproduce")
    source = _from_dump(dumps[-1], model, kind="run", run_dir=path)
    if len(dumps) > 1:
        others = ", ".join(d.name for d in dumps[:-1])
        source = _note(source, f"the run has {len(dumps)} dumps; the newest ({dumps[-1].name}) is taken "
                       f"(pass one of {others} to reproduce it instead)")
    return source


def _note(source: Source, line: str) -> Source:
    from dataclasses import replace

    return replace(source, recorded=source.recorded + (line,))


def _from_dump(dump: Path, model: str | Path | None, kind: str, run_dir: Path | None = None) -> Source:
    seqs = load_sequences(dump)
    model_dir = resolve_model(seqs.meta, model)
    if kind == "stress":
        return _from_stress(dump, model_dir, seqs)
    if run_dir is None and dump.parent.name == "dumps":
        run_dir = dump.parent.parent
    return _from_run_dump(dump, model_dir, seqs, kind, run_dir)


def _from_stress(dump: Path, model_dir: Path, seqs: DumpSequences) -> Source:
    from rlcheck.forensics.localize import stress_config
    from rlcheck.forensics.localize.engine import fault_name

    cfg = stress_config(dump, model_dir)
    failed = _column(dump, "failed")
    stress = (seqs.meta.get("context") or {}).get("stress") or {}
    num_failing = sum(map(bool, failed)) if failed else _failing(seqs, float(stress.get("threshold") or 1e-3))
    fault = fault_name(cfg) if cfg.fault != "none" else None
    source = Source("stress", dump, dump=dump, fault=fault, sequences=seqs, meta=seqs.meta)
    if not num_failing:
        return _nothing(source, f"the stress run in {dump} found no failing request ({len(seqs.prompts)} "
                        "requests within its threshold of the reference): nothing to reproduce")
    knobs: dict[str, Any] = {"enforce_eager": True, "max_num_seqs": cfg.max_num_seqs}
    if cfg.max_num_batched_tokens is not None:
        knobs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    batch = tuple(Request(tuple(p), cfg.max_tokens, rid) for p, rid in zip(seqs.prompts, seqs.request_ids, strict=True))
    case = Case(model=str(model_dir), batch=batch, knobs=tuple(knobs.items()),
                base=(("dtype", cfg.dtype), ("seed", cfg.seed), ("max_model_len", cfg.max_model_len),
                      ("kv_cache_memory_bytes", cfg.kv_cache_bytes)), fault=fault,
                weight_update=cfg.fault == "stale-buffer")  # stress syncs that fault's update before generating
    recorded = (f"the stress run's one generate call: {len(batch)} requests in arrival order, {cfg.max_tokens} "
                f"tokens each, greedy; {num_failing} failed there",
                f"its settings: max_num_seqs {cfg.max_num_seqs}, {cfg.kv_cache_bytes} bytes of cache, "
                f"max_model_len {cfg.max_model_len}, {cfg.dtype}, eager" + (f", fault {fault}" if fault else "")
                + ("; one weight sync before the generation" if case.weight_update else ""))
    return Source("stress", dump, dump=dump, case=case, fault=fault, recorded=recorded, sequences=seqs, meta=seqs.meta)


def _from_run_dump(dump: Path, model_dir: Path, seqs: DumpSequences, kind: str, run_dir: Path | None) -> Source:
    context = seqs.meta.get("context") or {}
    engine = context.get("engine") if isinstance(context.get("engine"), dict) else {}
    step = int(seqs.meta.get("step") or 0)
    version = max((int(v or 0) for v in _column(dump, "weight_version")), default=0)
    fault, fault_note = run_fault(context.get("fault"))
    batch = tuple(Request(tuple(p), max(1, len(r)), rid)
                  for p, r, rid in zip(seqs.prompts, seqs.responses, seqs.request_ids, strict=True))
    history = tuple(Request(r.prompt, r.max_tokens, f"{r.origin} (served before)") for r in batch) if step > 0 else ()
    knobs: dict[str, Any] = {"enforce_eager": True}
    if engine.get("max_num_seqs"):
        knobs["max_num_seqs"] = int(engine["max_num_seqs"])
    base: dict[str, Any] = {"dtype": str(engine.get("dtype") or _model_dtype(model_dir)), "seed": 0,
                            "max_model_len": DEFAULT_MAX_MODEL_LEN}
    if engine.get("kv_cache_bytes"):
        base["kv_cache_memory_bytes"] = int(engine["kv_cache_bytes"])
    case = Case(model=str(model_dir), batch=batch, history=history, knobs=tuple(knobs.items()),
                base=tuple(base.items()), weight_update=version > 0, fault=fault)
    sampling = context.get("sampling") or {}
    recorded = [f"step {step} of the run: {len(batch)} requests (sampled at temperature {sampling.get('temperature', '?')} "
                "there; greedy here, each as many tokens as its response held, EOS ignored)",
                f"the engine: {case.dtype}, {base.get('kv_cache_memory_bytes', 'default')} bytes of cache, "
                f"max_num_seqs {knobs.get('max_num_seqs', 'default')}, eager (rlcheck's engines are)"]
    if history:
        recorded.append(f"the engine had served {step} step(s) before: the case serves the step's requests once "
                        "before them (the earlier steps' requests are not in the dump)")
    if version:
        recorded.append(f"the rollouts carry weight version {version}: the run's synced weights are not in the dump, "
                        "so the case syncs a seeded 1% update of the model folder's weights before the batch")
    if fault:
        recorded.append(f"the run injected the engine fault {fault}: the case injects it too (RLCHECK_VLLM_FAULT)")
    return Source(kind, dump, dump=dump, run_dir=run_dir, case=case, fault=fault, fault_note=fault_note,
                  recorded=tuple(recorded), sequences=seqs, meta=seqs.meta)


def _nothing(source: Source, why: str) -> Source:
    from dataclasses import replace

    return replace(source, nothing=why)


def _failing(seqs: DumpSequences, threshold: float) -> int:
    import numpy as np

    if seqs.logp_train is None:
        return 0
    return sum(float(np.max(np.abs(a - b), initial=0.0)) > threshold
               for a, b in zip(seqs.logp_rollout, seqs.logp_train, strict=True))


def _column(dump: Path, name: str) -> list[Any]:
    """A per-sequence column of a dump ([] without it)."""
    from rlcheck.core.run.dump import read_dump

    rows, _ = read_dump(dump)
    return [r[name] for r in rows] if rows and all(name in r for r in rows) else []


def run_fault(spec: Any) -> tuple[str | None, str | None]:
    """(the run's engine fault as RLCHECK_VLLM_FAULT spells it, or None; a note when the run injected
    an engine fault the plugin cannot) from a dump's context.fault (`rlcheck demo --inject`'s spelling)."""
    from rlcheck.engines.vllm_plugin import PLUGIN_FAULTS, spelling
    from rlcheck.errors import ConfigError
    from rlcheck.faults import parse_inject

    if not spec or spec == "none":
        return None, None
    try:
        engine_fault = parse_inject(str(spec)).engine_fault()
    except ConfigError:
        return None, f"the run's fault {spec!r} is not one this rlcheck knows: not re-injected"
    if engine_fault is None:
        return None, None  # a fault of the trainer's side or of the data: the engine runs as it is
    kind, options = engine_fault
    if kind not in PLUGIN_FAULTS:
        return None, (f"the run injected {spec}, which acts through rlcheck's own loop (not a vLLM plugin fault): "
                      "the case runs without it")
    return spelling(kind, options), None


def _model_dtype(model_dir: Path) -> str:
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"float": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
