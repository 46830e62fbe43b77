"""Confusion matrix of rlcheck on the user's path (issue 37): every fault of docs/faults.md x the demo's
models x precision x trainer, through `rlcheck demo`'s loop (`tiny_cpu`, the Monitor's defaults, no
detector warmed up by hand), each fault from step 0 as `rlcheck demo --inject SPEC` starts it.

    .venv/bin/python benchmarks/bench_confusion.py --seed 1 --trainers hf --out runs/confusion     # one slice
    .venv/bin/python benchmarks/bench_confusion.py --seed 1 --report                                # the table so far
    .venv/bin/python benchmarks/bench_confusion.py --seed 1 --diagnose-only                         # diagnose again

Cells: models `MODELS` (the trained and random hybrid, the trained and random Llama, Mamba2, the
trained MoE), precisions `PRECISIONS` (fp32 engine and trainer; a bf16 engine against the fp32
trainer), trainers `TRAINERS` (hf, fsdp2 and deepspeed with 2 ranks, as the demo's defaults), every
fault where it applies (`FAULTS`: the Mamba state faults on the Mamba models, the long-prompt faults
on the attention-only ones, moe-route-flip on the MoE). Per cell: steps to the first alarm, the halt
step, diagnose's first cause. A run ends at its halt, `AFTER` steps after its first alarm, or after
`--steps`; a fault that touched no sequence (loop.jsonl's `fault_touched`: stop-token on a model that
never stops, retokenize on a trained model whose samples round-trip) never fired: it is refused and
listed, not counted.

Sharing (2 shared cores): per (model, precision, trainer) the faults that act through the loop's
hooks alone (`SHARED`: sync faults, data faults, trainer-input faults, and the healthy run first) run
one after the other in one loop (one vLLM engine, one trainer group), the fault and the Monitor
swapped between runs and the engine resynced to the trainer's weights; the faults that set up the
engine or the trainer (engine faults, engine settings, temperatures) get their own loop. A finished
run leaves `done.json` and is not run again; `--report` reads what has finished.

Calibration and held-out: the detectors and rules were designed on the loop runs of seed 0 with the
hf trainer (`CALIBRATION`); the table reports those cells apart from the held-out ones (other seeds,
other trainers, and the attention models and the MoE at bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODELS = {"hybrid-trained": ("hybrid", True), "hybrid": ("hybrid", False), "mamba2": ("mamba2", False),
          "llama-trained": ("llama", True), "llama": ("llama", False), "moe-trained": ("moe", True),
          "llama-calculator": ("llama", True)}
"""name -> (arch, trained): runs/models/NAME, built once (`ensure_trained` / `build_model`; NAME-calculator trained
on the multi-turn calculator task, the others on the demo's addition task)."""
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
"""The engine's dtype; the trainer computes in float32."""
TRAINERS = {"hf": 1, "fsdp2": 2, "deepspeed": 2}
MAMBA, ATTENTION, MOE = {"hybrid-trained", "hybrid", "mamba2"}, {"llama-trained", "llama", "llama-calculator"}, {"moe-trained"}
SHARED = ("none", "skip-sync-every=4", "stale-weights", "off-by-one", "off-by-one-early", "bf16-noise={noise}",
          "corrupt-seqs=0.03",
          "drop-sync={drop}", "permute-sync={permute}", "retokenize", "double-bos", "left-pad-positions", "stop-token")
OWN = {"temperature-mismatch=1.1": None, "top-p=0.9": None, "raw-logprobs": None, "perturb-layer=1": None,
       "stale-state": MAMBA, "index-wrap=16": MAMBA, "stale-buffer": MAMBA, "moe-route-flip=0.1": MOE,
       "stale-prefix-cache": ATTENTION, "rope-mismatch=4": ATTENTION}
"""Faults with their own loop, and the models they apply to (None: every model)."""
PATTERNS = {"mamba2": {"drop": "out_proj", "permute": "in_proj"}}
"""drop-sync / permute-sync patterns where the default ("mlp", "self_attn") names no tensor."""
DEFAULT_PATTERNS = {"drop": "mlp", "permute": "self_attn"}
NOISE = {"fp32": 1, "bf16": 16}
"""bf16-noise's scale: bf16-sized rounding on a fp32 engine; on a bf16 engine 1x is its own noise (no fault at
that precision: `WITHIN_NOISE`), 16x stands past its floor."""
WITHIN_NOISE = {("bf16-noise=1", "bf16", None), ("left-pad-positions", "bf16", "hybrid-trained"),
                ("left-pad-positions", "bf16", "hybrid"),
                ("rope-mismatch=4", "bf16", "llama"), ("moe-route-flip=0.1", "bf16", "moe-trained"),
                ("left-pad-positions", "bf16", "moe-trained"), ("stale-prefix-cache", "bf16", "llama-calculator")}
"""(spec, precision, model or None: every model) cells whose fault stays within that precision's own noise:
listed apart with their verdict, not in the matrix. The trained hybrid's prompts differ by at most one token:
left-pad-positions pads the short one by a single token: its rows' shift (fp32: a median 1e-3 nats a step, at
most 0.023) is under a bf16 engine's noise on the same rows (a median 7.7e-3; `bench_pad_floor.py`;
BENCHMARKS.md, "Left padding under a bf16 engine's noise"). rope-mismatch=4 on the random Llama (fp32: a clipped mean
|d| of 0.012 a step) puts a bf16 engine's run at 0.022-0.024 a step against its healthy run's 0.017-0.020 (seeds
0-2): 1.25x, with no healthy reference in a run faulty from its first step, under the gate (0.05). moe-route-flip=0.1
on the trained MoE with a bf16 engine reroutes what the engine's rounding reroutes already: its healthy run agrees on
95-100% of the tokens a step at a clipped mean of 0.011-0.021, the fault's runs 94-99.6% at 0.008-0.028 (seeds 1-2).
stale-prefix-cache on the trained calculator Llama: the prefix rows' own shift at fp32 a median 3e-4 nats a step (at
most 3.8e-3, seeds 1-2); with a bf16 engine those rows sit at 0.5-1.0x the others and the step at 0.6-1.1x the
trainer's measure (seeds 0-5; BENCHMARKS.md, "The engine over the trainer's measure").
left-pad-positions on the random hybrid: its own size (fp32) a median 0.012 nats on the padded rows (at most 0.026), under a
bf16 engine's noise on the same rows (healthy: a median 0.028; the fault's padded/other ratio a median 1.11 a step,
the healthy 1.01; seeds 1-2, `bench_pad_floor.py --model hybrid`). left-pad-positions on the trained MoE: its own size (fp32) a median 4.9e-3 nats on the padded rows (at most 0.032),
under a bf16 engine's noise on the same rows (healthy: a median 0.013, at most 0.078; on an AVX512-BF16 CPU, seeds
1-2: a fault step against a healthy one, AUC 0.51 on the padded/other ratio, 0.61 on the padded rows' |d|)."""
AFTER = 2
CALIBRATION = {"seed": 0, "trainer": "hf", "models": {"fp32": set(MODELS), "bf16": MAMBA | {"llama-trained"}}}


class StopRun(Exception):
    """Raised by the step callback to end a run (enough steps after its first alarm)."""


@dataclasses.dataclass(frozen=True)
class Cell:
    spec: str
    model: str
    precision: str
    trainer: str
    seed: int

    def run_dir(self, out: Path) -> Path:
        name = self.spec.replace("@", "_at").replace("=", "-")
        return out / f"seed{self.seed}" / f"{self.model}-{self.precision}-{self.trainer}" / name

    @property
    def calibration(self) -> bool:
        c = CALIBRATION
        return self.seed == c["seed"] and self.trainer == c["trainer"] and self.model in c["models"][self.precision]


SHARED_WHERE = {"corrupt-seqs=0.03": MAMBA}
"""Shared-loop faults that apply to some models only. corrupt-seqs imitates stale state (a few sequences gibberish
from their first tokens) and is judged by that name, which a model without recurrent state cannot have: there
diagnose says what such rows are (split twins: `token_misalignment`, 0.6; on the trained MoE both precisions)."""


def specs(model: str, precision: str) -> tuple[list[str], list[str]]:
    """(the shared loop's specs, the own-loop specs) that apply to `model` at `precision`."""
    patterns = PATTERNS.get(model, DEFAULT_PATTERNS)
    shared = [s.format(noise=NOISE[precision], **patterns) for s in SHARED if model in SHARED_WHERE.get(s, {model})]
    return shared, [s for s, where in OWN.items() if where is None or model in where]


def loop_config(cell: Cell, steps: int, fault):
    from rlcheck.loop.presets import tiny_cpu

    return tiny_cpu(f"runs/models/{cell.model}", trainer=cell.trainer, world_size=TRAINERS[cell.trainer],
                    steps=steps, fault=fault, seed=cell.seed, engine_dtype=PRECISIONS[cell.precision])


def monitor_for(cell: Cell, out: Path, cfg):
    from rlcheck.core.monitor import Monitor, MonitorConfig

    run_dir = cell.run_dir(out)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short before: start it over
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context=cfg.context())), run_dir


def run_cell(loop, cell: Cell, out: Path, steps: int) -> dict:
    """One run on a started loop (its fault and Monitor already set): until the halt, AFTER steps after
    the first alarm, or `steps`."""
    first: list[int] = []

    def on_step(step, report, info) -> None:
        if report.alarms and not first:
            first.append(step)
        if first and step >= first[0] + AFTER and not info.get("halted"):
            raise StopRun

    t0, result, error = time.perf_counter(), None, None
    try:
        result = loop.run(on_step)
    except StopRun:
        pass
    except Exception as exc:  # noqa: BLE001 - a run that fails is a row of the table
        error = f"{type(exc).__name__}: {exc}"[:500]
    return {"first_alarm": first[0] if first else None, "halted": bool(result is not None and result.halted),
            "error": error, "seconds": round(time.perf_counter() - t0, 1)}


def finish(cell: Cell, out: Path, fault, outcome: dict) -> dict:
    """done.json of a run: the cell, the fault's cause and what it touched (loop.jsonl), the outcome."""
    run_dir = cell.run_dir(out)
    touched = {}
    loop_file = run_dir / "loop.jsonl"
    for line in loop_file.read_text().splitlines() if loop_file.is_file() else ():
        rec = json.loads(line)
        if rec.get("fault_touched"):
            touched[rec["step"]] = len(rec["fault_touched"])
    records = run_dir / "metrics.jsonl"
    steps = len(records.read_text().splitlines()) if records.is_file() else 0
    done = {**dataclasses.asdict(cell), "cause": fault.cause, "calibration": cell.calibration,
            "steps": steps, "touched_steps": sorted(touched), "touched": sum(touched.values()), **outcome}
    done["halt_step"] = steps - 1 if done["halted"] else None
    (run_dir / "done.json").write_text(json.dumps(done))
    print(json.dumps(done), flush=True)
    return done


def run_shared(cells: list[Cell], out: Path, steps: int) -> None:
    """The shared faults of one (model, precision, trainer), in one loop: fault and Monitor swapped."""
    from rlcheck.faults import Fault, parse_inject
    from rlcheck.loop import GRPOLoop

    todo = [c for c in cells if not (c.run_dir(out) / "done.json").is_file()]
    if not todo:
        return
    base = loop_config(todo[0], steps, Fault())
    mon, _ = monitor_for(todo[0], out, base)
    try:
        loop = GRPOLoop(base, mon)
    except BaseException:
        mon.close()
        raise
    try:
        for i, cell in enumerate(todo):
            fault = parse_inject(None if cell.spec == "none" else cell.spec, seed=cell.seed)
            loop.cfg = dataclasses.replace(base, fault=fault)
            if i:
                loop.monitor, _ = monitor_for(cell, out, loop.cfg)
                _resync(loop)
            outcome = run_cell(loop, cell, out, steps)
            loop.monitor.close()  # closed already after a halt: a second close does nothing
            finish(cell, out, fault, outcome)
    finally:
        loop.monitor.close()
        loop.close()


def _resync(loop) -> None:
    """The engine back on the trainer's weights where a fault's skipped or spoiled syncs left it elsewhere (sent
    as a new version: the engine takes only increasing ones), unchecked."""
    stale = loop.spoiled or loop.synced != loop.version
    loop.fault_touched, loop.spoiled = [], False
    if stale:
        loop.version += 1
        loop._sync(-1)
    loop.checker.pending = None


def run_own(cell: Cell, out: Path, steps: int) -> None:
    from rlcheck.faults import parse_inject
    from rlcheck.loop import GRPOLoop

    if (cell.run_dir(out) / "done.json").is_file():
        return
    fault = parse_inject(cell.spec, seed=cell.seed)
    cfg = loop_config(cell, steps, fault)
    mon, run_dir = monitor_for(cell, out, cfg)
    outcome = None
    try:
        loop = GRPOLoop(cfg, mon)
    except Exception as exc:  # noqa: BLE001 - refused at setup (a row, with its reason)
        outcome = {"first_alarm": None, "halted": False, "error": f"{type(exc).__name__}: {exc}"[:500], "seconds": 0.0}
    if outcome is None:
        try:
            outcome = run_cell(loop, cell, out, steps)
        finally:
            loop.close()
    mon.close()
    finish(cell, out, fault, outcome)


def ensure_models(names) -> None:
    from rlcheck.modelzoo import build_model, ensure_trained

    for name in names:
        arch, trained = MODELS[name]
        path = Path("runs/models") / name
        if trained:
            ensure_trained(path, arch, **({"task": "calculator"} if name.endswith("-calculator") else {}))
        elif not (path / "config.json").is_file():
            build_model(arch, path)


def run_all(models, precisions, trainers, seed: int, out: Path, steps: int, only) -> None:
    from rlcheck.loop import ray_session

    ensure_models(models)
    with ray_session(num_cpus=4, log_to_driver=False):
        for trainer in trainers:
            for precision in precisions:
                for model in models:
                    shared, own = specs(model, precision)
                    run_shared([Cell(s, model, precision, trainer, seed) for s in shared if _kept(s, only)], out, steps)
                    for s in own:
                        if _kept(s, only):
                            run_own(Cell(s, model, precision, trainer, seed), out, steps)


def _kept(spec: str, only) -> bool:
    return only is None or any(spec.startswith(p) for p in only)


def diagnosed(run_dir: Path, again: bool) -> dict:
    """done.json with diagnose's verdict (cached in verdict.json unless `again`)."""
    done = json.loads((run_dir / "done.json").read_text())
    cached = run_dir / "verdict.json"
    if cached.is_file() and not again:
        return {**done, **json.loads(cached.read_text())}
    verdict = {"verdict": None, "confidence": None, "also": []}
    if (run_dir / "metrics.jsonl").is_file() and done["steps"]:
        from rlcheck.forensics.diagnose import diagnose

        d = diagnose(run_dir)
        verdict = {"verdict": d.verdict.cause, "confidence": round(d.verdict.confidence, 2),
                   "also": [f.cause for f in d.findings[1:3]]}
    cached.write_text(json.dumps(verdict))
    return {**done, **verdict}


def report(rows: list[dict]) -> str:
    """The matrix (calibration and held-out apart), the state faults' halts, the refused and failed runs."""
    lines = []
    within = [r for r in rows if within_noise(r)]
    rows = [r for r in rows if r not in within]
    ran = [r for r in rows if not r["error"] and (r["touched"] or r["spec"] == "none")]
    for title, part in (("calibration", [r for r in ran if r["calibration"]]), ("held-out", [r for r in ran if not r["calibration"]])):
        if part:
            lines += [f"### {title}: {len(part)} runs", "", matrix(part), "", summary(part), ""]
    never = [r for r in rows if not r["error"] and not r["touched"] and r["spec"] != "none"]
    failed = [r for r in rows if r["error"]]
    if never:
        lines.append("Never fired (refused, not counted): " + ", ".join(sorted(_cell(r) for r in never)))
    if failed:
        lines.append("Failed: " + "; ".join(f"{_cell(r)}: {r['error'][:120]}" for r in failed))
    if within:
        lines.append("Within the precision's noise (no fault there, not counted): " + ", ".join(
            f"{_cell(r)} -> {r['verdict']}" for r in within))
    return "\n".join(lines)


def within_noise(r: dict) -> bool:
    return any(r["spec"] == spec and r["precision"] == precision and model in (None, r["model"])
               for spec, precision, model in WITHIN_NOISE)


def _cell(r: dict) -> str:
    return f"{r['spec']} on {r['model']}/{r['precision']}/{r['trainer']}"


def matrix(rows: list[dict]) -> str:
    """Rows the injected cause, columns the diagnosed one."""
    truth = sorted({r["cause"] for r in rows}, key=lambda c: (c != "healthy", c))
    said = sorted({r["verdict"] for r in rows}, key=lambda c: (c != "healthy", c not in truth, c))
    counts = Counter((r["cause"], r["verdict"]) for r in rows)
    out = ["| injected \\ diagnosed | " + " | ".join(said) + " | right |", "|---" * (len(said) + 2) + "|"]
    for t in truth:
        n = sum(counts[(t, s)] for s in said)
        cells = [f"**{counts[(t, s)]}**" if s == t and counts[(t, s)] else str(counts[(t, s)] or ".") for s in said]
        out.append(f"| {t} | " + " | ".join(cells) + f" | {counts[(t, t)]}/{n} |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    """Named right first, never healthy, healthy cells' alarms, and the state faults' halts."""
    faults = [r for r in rows if r["spec"] != "none"]
    healthy = [r for r in rows if r["spec"] == "none"]
    right = sum(r["verdict"] == r["cause"] for r in faults)
    state = [r for r in faults if r["spec"] in ("stale-state", "index-wrap=16")]
    on_time = [r for r in state if r["halted"] and r["touched_steps"] and r["halt_step"] - r["touched_steps"][0] <= 2]
    return (f"faults named right first: {right}/{len(faults)}; called healthy: {sum(r['verdict'] == 'healthy' for r in faults)}; "
            f"healthy runs with an alarm: {sum(r['first_alarm'] is not None for r in healthy)}/{len(healthy)}; "
            f"state faults halted within 2 steps of their first touched step: {len(on_time)}/{len(state)}; "
            "first alarm step by fault: " + ", ".join(
                f"{spec} {sorted(r['first_alarm'] for r in faults if r['spec'] == spec and r['first_alarm'] is not None)}"
                for spec in sorted({r['spec'] for r in faults})))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    ap.add_argument("--steps", type=int, default=8, help="a run's most steps")
    ap.add_argument("--out", type=Path, default=Path("runs/confusion"))
    ap.add_argument("--only", nargs="*", default=None, help="the specs that start with one of these")
    ap.add_argument("--report", action="store_true", help="the table of the finished runs, run nothing")
    ap.add_argument("--diagnose-only", action="store_true", help="diagnose the finished runs again, run nothing")
    args = ap.parse_args()
    if not (args.report or args.diagnose_only):
        run_all(args.models, args.precisions, args.trainers, args.seed, args.out, args.steps, args.only)
    rows = [diagnosed(p.parent, args.diagnose_only) for p in sorted(args.out.glob("seed*/*/*/done.json"))]
    by_group = defaultdict(list)
    for r in rows:
        by_group[(r["model"], r["precision"], r["trainer"], r["seed"])].append(r)
    for key, group in sorted(by_group.items()):
        print(" ".join(map(str, key)) + ": " + ", ".join(
            f"{r['spec']}:{'ok' if r['verdict'] == r['cause'] else r['verdict']}@{r['first_alarm']}/{r['halt_step']}" for r in group))
    print()
    print(report(rows))


if __name__ == "__main__":
    main()
