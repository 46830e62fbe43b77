"""Detection power in the real loop: per fault and intensity, steps from the fault's onset to rlcheck's
first alarm and to its halt, and whether `diagnose` names the cause; beside it, the default gates of
the anchors (TRL, NeMo-RL, verl) computed on the same metrics; and the false alarms of clean runs.

    .venv/bin/python benchmarks/bench_detection.py [--out /tmp/rlcheck-detection] [--clean-steps 100]
    .venv/bin/python benchmarks/bench_detection.py --table-only   # re-read the run dirs, run nothing

Every case runs `rlcheck.loop.run_grpo` with `tiny_cpu(model, trainer="hf")` (vLLM rollout actor, one
HF trainer rank, the default Monitor with the JSONL sink; halting on) in one local Ray session, one run
directory per case under `--out`. Faults start at step 32, when the rolling detectors are warm (the
temperature mismatch acts from step 0), and a run lasts 40 steps past that (8 periods for skip-sync),
fewer when the monitor halts it. Onset is the first step the fault touched (`loop.jsonl`:
`fault_touched`) or whose rollouts came from old weights (`loop/weights_behind` > 0).

From each run's `metrics.jsonl`: rlcheck's first alarm of any severity and its first critical one at
or after the onset, the halt step, alarms before the onset, and `diagnose(run_dir).verdict.cause`
against the fault's `cause`. The anchors' gates, applied to the same step metrics:

- TRL: logs mean and max |d| of its vLLM importance-sampling correction
  (`sampling/sampling_logp_difference/mean`) but gates nothing; we use mean |d| > `--trl-gate`
  (default 0.01 nat, a 1% per-token probability error, the level of verl's probs-diff gate).
- NeMo-RL: mean exp|d| (`token_mult_prob_error`) <= 1.05 is healthy, so > 1.05 fires.
- verl: mean |p_train - p_rollout| (`training/rollout_probs_diff_mean`) > 0.01 fires.

A gate that never fired reads "never", or "not before halt" when the run stopped first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlcheck.core import metrics as K

ONSET = 32
"""Start of every fault that can start late: the robust-z and periodic detectors' warm-up."""
AFTER_ONSET = 40
FAULT_SPECS = (
    "skip-sync-every=3@32", "skip-sync-every=6@32", "stale-weights@32",
    "temperature-mismatch=1.02", "temperature-mismatch=1.1", "off-by-one@32",
    "bf16-noise=0.25@32", "bf16-noise=1@32", "bf16-noise=4@32",
    "corrupt-seqs=0.02@32", "corrupt-seqs=0.1@32",
    "drop-sync=shared_mlp@32", "drop-sync=self_attn@32", "stale-buffer",
)
CLEAN_SEEDS = (0, 1)


@dataclass(frozen=True)
class Case:
    spec: str | None
    """The fault as `parse_inject` reads it; None for a clean run."""
    steps: int
    seed: int = 0

    @property
    def name(self) -> str:
        if self.spec is None:
            return f"clean-seed{self.seed}"
        return self.spec.replace("=", "-").replace("@", "-at-")

    def fault(self):
        from rlcheck.faults import parse_inject

        return parse_inject(self.spec, seed=self.seed)


def cases(clean_steps: int) -> list[Case]:
    out = []
    for spec in FAULT_SPECS:
        fault = Case(spec, 1).fault()
        periods = 8 * fault.every if fault.name == "skip-sync-every" else 0
        out.append(Case(spec, fault.start + max(AFTER_ONSET, periods)))
    return out + [Case(None, clean_steps, seed) for seed in CLEAN_SEEDS]


# ---- running -----------------------------------------------------------------------------------


def run_case(case: Case, model: str, run_dir: Path) -> None:
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.loop import run_grpo
    from rlcheck.loop.presets import tiny_cpu

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = tiny_cpu(model, trainer="hf", steps=case.steps, fault=case.fault(), seed=case.seed)
    t0 = time.perf_counter()
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), resume=False,
                               context={"source": "bench_detection", **cfg.context()})) as mon:
        result = run_grpo(cfg, mon)
    end = f"halted at step {result.steps_run - 1}" if result.halted else "no halt"
    print(f"  {case.name}: {result.steps_run} steps, {end}, {time.perf_counter() - t0:.0f} s", flush=True)


def ensure_model(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        from rlcheck.modelzoo import build_model

        print(f"building the tiny hybrid model into {path}", flush=True)
        build_model("hybrid", path)
    return path


# ---- reading a run -----------------------------------------------------------------------------


@dataclass
class RunFacts:
    steps: list[int]
    metrics: dict[int, dict[str, float]]
    alarms: dict[int, list[dict]]
    onset: int | None
    halt_step: int | None
    verdict: str


def read_run(run_dir: Path) -> RunFacts:
    from rlcheck.core.run.journal import FILENAME, read_jsonl
    from rlcheck.forensics.diagnose import diagnose

    records = sorted(read_jsonl(run_dir / FILENAME), key=lambda r: r["step"])
    loop_log = run_dir / "loop.jsonl"
    loop = [json.loads(line) for line in loop_log.read_text().splitlines() if line] if loop_log.is_file() else []
    touched = [r["step"] for r in loop if r.get("fault_touched")]
    behind = [r["step"] for r in records if r["metrics"].get("loop/weights_behind", 0.0) > 0]
    onsets = touched[:1] + behind[:1]
    halts = [r["step"] for r in loop if r.get("halted")]
    return RunFacts(
        steps=[r["step"] for r in records],
        metrics={r["step"]: r["metrics"] for r in records},
        alarms={r["step"]: r.get("alarms", []) for r in records},
        onset=min(onsets) if onsets else None,
        halt_step=halts[0] if halts else None,
        verdict=diagnose(run_dir).verdict.cause,
    )


def anchors(trl_gate: float) -> tuple[tuple[str, str, float], ...]:
    """(column title, metric, gate): the gate fires when the metric is above it."""
    return (
        (f"TRL mean \\|d\\| > {trl_gate:g}", K.ABS_DIFF_MEAN, trl_gate),
        ("NeMo-RL mean e^\\|d\\| > 1.05", K.MULT_PROB_ERROR, 1.05),
        ("verl probs diff > 0.01", K.PROB_ABS_DIFF_MEAN, 0.01),
    )


def first_step(steps: list[int], fires, since: int) -> int | None:
    return next((s for s in steps if s >= since and fires(s)), None)


def delay(facts: RunFacts, step: int | None, what: str = "") -> str:
    if step is None:
        return "not before halt" if facts.halt_step is not None else "never"
    return f"+{step - facts.onset}" + (f" ({what})" if what else "")


def alarm_kinds(alarms: list[dict]) -> str:
    """Each alarm kind once, with the highest severity it was raised at: "robust_z/warn, signature/critical"."""
    from rlcheck.core.detect import severity_rank

    top: dict[str, str] = {}
    for a in alarms:
        if a["kind"] not in top or severity_rank(a["severity"]) > severity_rank(top[a["kind"]]):
            top[a["kind"]] = a["severity"]
    return ", ".join(f"{kind}/{sev}" for kind, sev in sorted(top.items()))


def fault_row(case: Case, facts: RunFacts, gates) -> str:
    fault = case.fault()
    if facts.onset is None:
        blank = ["-"] * (6 + len(gates))
        return "| " + " | ".join([fault.name, fault.value() or "-", "none seen", str(len(facts.steps)), *blank]) + " |"
    on, steps = facts.onset, facts.steps
    first = first_step(steps, lambda s: facts.alarms[s], on)
    crit = first_step(steps, lambda s: any(a["severity"] == "critical" for a in facts.alarms[s]), on)
    kinds = "" if first is None else alarm_kinds(facts.alarms[first])
    crit_kinds = "" if crit is None else alarm_kinds([a for a in facts.alarms[crit] if a["severity"] == "critical"])
    halt = "no halt" if facts.halt_step is None else f"+{facts.halt_step - on}"
    pre = sum(1 for s in steps if s < on and facts.alarms[s])
    peak = max(facts.metrics[s][K.ABS_DIFF_MEAN] for s in steps if s >= on)
    ok = "yes" if facts.verdict == fault.cause else f"**no** (want {fault.cause})"
    cells = [fault.name, fault.value() or "-", str(on), str(len(steps)), str(pre), delay(facts, first, kinds),
             delay(facts, crit, crit_kinds), halt, f"{facts.verdict}: {ok}", f"{peak:.2g}"]
    cells += [delay(facts, first_step(steps, lambda s, m=m, g=g: facts.metrics[s][m] > g, on)) for _, m, g in gates]
    return "| " + " | ".join(cells) + " |"


def clean_row(case: Case, facts: RunFacts, gates) -> str:
    steps = facts.steps
    alarmed = [s for s in steps if facts.alarms[s]]
    crit = [s for s in steps if any(a["severity"] == "critical" for a in facts.alarms[s])]
    kinds = sorted({a["kind"] for s in alarmed for a in facts.alarms[s]})
    peak = max(facts.metrics[s][K.ABS_DIFF_MEAN] for s in steps)
    cells = [f"seed {case.seed}", str(len(steps)), f"{len(alarmed)}" + (f" ({', '.join(kinds)})" if kinds else ""),
             str(len(crit)), "yes" if facts.halt_step is not None else "no", facts.verdict, f"{peak:.2g}"]
    cells += [str(sum(1 for s in steps if facts.metrics[s][m] > g)) for _, m, g in gates]
    return "| " + " | ".join(cells) + " |"


def print_tables(all_cases: list[Case], out: Path, trl_gate: float) -> None:
    gates = anchors(trl_gate)
    heads = [t for t, _, _ in gates]
    print("| fault | intensity | onset step | steps run | steps alarmed before onset | rlcheck first alarm "
          "| first critical | halt | diagnose verdict: right? | peak mean \\|d\\| | " + " | ".join(heads) + " |")
    print("|---" * (10 + len(heads)) + "|")
    clean = []
    for case in all_cases:
        if not (out / case.name / "metrics.jsonl").is_file():
            print(f"<!-- {case.name}: no run directory in {out} -->")
        elif case.spec is None:
            clean.append(case)
        else:
            print(fault_row(case, read_run(out / case.name), gates), flush=True)
    print("\n| clean run | steps | steps with an rlcheck alarm | critical | halted | diagnose verdict "
          "| peak mean \\|d\\| | " + " | ".join(f"steps {h}" for h in heads) + " |")
    print("|---" * (7 + len(heads)) + "|")
    for case in clean:
        print(clean_row(case, read_run(out / case.name), gates), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlcheck-detection"), help="run directories go here")
    ap.add_argument("--model", default="runs/models/hybrid", help="tiny hybrid model dir, built if missing")
    ap.add_argument("--clean-steps", type=int, default=100, help="steps of each clean run")
    ap.add_argument("--trl-gate", type=float, default=0.01, help="mean |d| gate standing in for TRL's")
    ap.add_argument("--only", nargs="*", help="run only the cases with these run-dir names")
    ap.add_argument("--table-only", action="store_true", help="print the tables from existing run dirs")
    args = ap.parse_args()

    print(f"command: `{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}`\n", flush=True)
    all_cases = cases(args.clean_steps)
    if not args.table_only:
        from rlcheck.loop import ray_session

        todo = [c for c in all_cases if not args.only or c.name in args.only]
        model = ensure_model(args.model)
        t0 = time.perf_counter()
        with ray_session(num_cpus=4):
            for i, case in enumerate(todo, 1):
                print(f"[{i}/{len(todo)}] {case.spec or 'clean'} (seed {case.seed}), up to {case.steps} steps",
                      flush=True)
                run_case(case, model, args.out / case.name)
        print(f"all runs: {time.perf_counter() - t0:.0f} s\n", flush=True)
    print_tables(all_cases, args.out, args.trl_gate)


if __name__ == "__main__":
    main()
