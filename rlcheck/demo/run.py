"""`rlcheck demo`: the product's main job, end to end, on this machine.

A tiny attention + Mamba2 hybrid *trained* on the toy addition task (`rlcheck.modelzoo.ensure_trained`,
built once on first use into `runs/models/hybrid-trained`, a few CPU minutes: peaked distributions
like a real LM's, a task reward of ~0.5 to start from; `--model runs/models/hybrid` selects the
earlier random hybrid, built in seconds, `--model runs/models/llama-trained` a trained Llama) is
trained further with GRPO on the task: a vLLM rollout actor and a trainer group (FSDP2 or DeepSpeed ranks, torch.distributed over
gloo) run as Ray actors; before every update the trainer recomputes the rollout tokens' logprobs,
the monitor compares them (JSONL, a W&B offline run), and the new weights go back into vLLM.
`--inject skip-sync-every=K` leaves the sync out after every K-th update: the rollouts of step K then
carry a weights version behind the trainer's, and the monitor halts there (a `weights` alarm) with a
dump; `--inject drop-sync=PATTERN` and `stale-buffer` spoil every sync while it still counts as done,
and the sync check halts the first step after it, naming the decoder layers. `--quarantine` takes the
sequences the evidence condemns out of the step (and the loss) instead of halting: with
`--inject corrupt-seqs=R` the run goes to its end, quarantining the corrupted sequences that are
far off (on the confident trained model most of them claim ~0 logprob for tokens the trainer also
finds near-certain, and stay); with `stale-state` it still halts (too much to mask). A closing summary says what it found.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.floors import LEVELS
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.types import StepReport
from rlcheck.faults import CorruptSequences, Fault, SkipSync, parse_inject
from rlcheck.loop.driver import PHASES

DEFAULT_STEPS = 20
INJECTED_MAX_STEPS = 100
DEFAULT_MODEL = Path("runs/models/hybrid-trained")
"""The demo's model folder; a folder named `<arch>-trained` gets a trained model of that arch, any
other name the random hybrid (`ensure_model`)."""
CALCULATOR_MODEL = Path("runs/models/llama-calculator")
"""The model of `--task calculator`: the tiny Llama trained on the calculator's tool-calling dialogues."""
"""With a fault injected the demo runs until the monitor halts, at most this many steps (the
detectors' rolling baselines warm up over 32 steps before the periodic test may fire)."""


@dataclass(frozen=True)
class DemoOptions:
    run_dir: Path
    model: Path = DEFAULT_MODEL
    trainer: str = "fsdp2"
    world_size: int = 2
    steps: int | None = None
    inject: str | None = None
    wandb: bool = True
    seed: int = 0
    guard: bool = False
    """Run the rollout engine with the engine guard (rlcheck.engines.guard)."""
    quarantine: bool = False
    """Quarantine condemned sequences instead of halting (`rlcheck.core.quarantine`, defaults)."""
    correction: str | None = None
    """The loss's IS correction: "token" (token TIS, cap 2), "sequence" (sequence TIS, cap 2) or
    "geometric" (exp(mean d), cap 2; `rlcheck.core.correction`)."""
    top_k: int = 0
    """Top-k distribution metrics (`rlcheck/dist/*`): the engine returns each position's top-k
    logprobs, the trainer scores the same ids and its own top-k (`rlcheck.loop.topk_wiring`); 0: off."""

    audit: bool = False
    """The decode-prefill audit on 8 rollouts a step (`rlcheck.loop.audit.DecodePrefillAudit`)."""
    weight_sync: str = "object-store"
    """How the weights reach vLLM after each update (`rlcheck.loop.weight_sync`): "object-store" or "collective"."""
    task: str = "addition"
    """"addition" (one call per rollout) or "calculator": multi-turn episodes with a tool
    (`rlcheck.loop.agent`), on `CALCULATOR_MODEL` unless `model` names another."""
    engine_dtype: str = "float32"
    """vLLM's dtype: "float32" (both sides fp32, ~1e-6 apart) or "bfloat16" (a bf16 engine against the
    fp32 trainer, ~1e-2); the Monitor judges the run at that pair's floor (`rlcheck.core.floors`)."""

    @property
    def fault(self) -> Fault:
        return parse_inject(self.inject, seed=self.seed)

    @property
    def model_dir(self) -> Path:
        """The model folder: the calculator's own when the task is it and `model` is left at the default."""
        return CALCULATOR_MODEL if self.task == "calculator" and self.model == DEFAULT_MODEL else self.model

    @property
    def max_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return INJECTED_MAX_STEPS if self.inject else DEFAULT_STEPS


def ensure_model(path: Path, console: Any) -> Path:
    """The tiny model at `path`, built there first if the folder holds none
    (`rlcheck.modelzoo.ensure_model`: trained for a folder named `<arch>-trained`, the default
    `runs/models/hybrid-trained`, a few CPU minutes once; else the random hybrid, seconds)."""
    if (path / "config.json").exists():
        return path
    from rlcheck.modelzoo import ensure_model as build_missing

    with console.status(f"building the tiny model in {path} (a trained one takes a few CPU minutes, once) ..."):
        return build_missing(path)


def run_demo(opts: DemoOptions, console: Any) -> dict[str, Any]:
    """Run the loop; returns what was found (also printed)."""
    from rlcheck.loop import GRPOLoop, ray_session
    from rlcheck.loop.presets import tiny_cpu

    fault = opts.fault
    os.environ.setdefault("WANDB_SILENT", "true")  # the summary below says where the W&B run is
    model = ensure_model(opts.model_dir, console)
    cfg = tiny_cpu(model, trainer=opts.trainer, world_size=opts.world_size, steps=opts.max_steps,
                   fault=fault, seed=opts.seed, guard=opts.guard, task=opts.task,
                   engine_dtype=opts.engine_dtype)
    if opts.correction is not None:
        from rlcheck.core.correction import CorrectionConfig

        cfg = dataclasses.replace(cfg, correction=CorrectionConfig(rollout_is=opts.correction))
    if opts.audit:
        from rlcheck.loop.audit import DecodePrefillAudit

        cfg = dataclasses.replace(cfg, audit=DecodePrefillAudit())
    if opts.top_k:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, top_logprobs=opts.top_k))
    if opts.weight_sync != "object-store":
        from rlcheck.loop.weight_sync import WeightSyncConfig

        cfg = dataclasses.replace(cfg, weight_sync=WeightSyncConfig(opts.weight_sync))
    found: dict[str, Any] = {"fault": fault, "run_dir": opts.run_dir}
    with ray_session(num_cpus=max(4, cfg.world_size + 1)), Monitor(monitor_config(opts, cfg)) as mon:
        with console.status(f"starting Ray actors: a vLLM rollout engine and {cfg.world_size} "
                            f"{cfg.trainer.backend} trainer rank(s) ..."):
            loop = GRPOLoop(cfg, mon)
        try:
            _run_with_progress(loop, opts, found, console)
        finally:
            loop.close()
    _print_found(found, console)
    return found


def monitor_config(opts: DemoOptions, cfg) -> MonitorConfig:
    """The demo's Monitor for the loop config `cfg` (its context names both sides' dtypes: the run's floor)."""
    from rlcheck.core.quarantine import QuarantineConfig
    from rlcheck.core.stats import StatsConfig
    from rlcheck.sinks.wandb import WandbConfig

    return MonitorConfig(
        run_dir=opts.run_dir,
        stats=StatsConfig(distribution=bool(opts.top_k)),
        quarantine=QuarantineConfig() if opts.quarantine else None,
        correction=cfg.correction,
        sinks=("jsonl", "wandb") if opts.wandb else ("jsonl",),
        resume=False,
        wandb=WandbConfig(mode=os.environ.get("WANDB_MODE", "offline"), name=opts.run_dir.name, tags=("demo",)),
        context={"source": "rlcheck demo", **cfg.context()},
    )


def _run_with_progress(loop, opts: DemoOptions, found: dict[str, Any], console: Any) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]rlcheck demo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=opts.max_steps)

        touched: set[str] = set()
        reach = Reach()
        quarantined: dict[str, str] = {}

        def on_step(step: int, report: StepReport, info: dict[str, Any]) -> None:
            for a in report.alarms:
                progress.console.print(f"[yellow]step {step}[/] {a.kind}/{a.severity}: {a.message}")
            skipped = " (sync skipped)" if info.get("sync_skipped") else ""
            held = ""
            reach.add(step, report, info.get("fault_touched") or ())
            if not report.halted:
                touched.update(info.get("fault_touched") or ())
                quarantined.update({q.request_id: q.reason for q in report.quarantined})
                held = f"  quarantined {len(quarantined)}" if opts.quarantine else ""
            reward = report.metrics.get("loop/reward_mean", float("nan"))
            kl = f"  top-k KL {report.metrics[K.DIST_KL_MEAN]:.2g}" if K.DIST_KL_MEAN in report.metrics else ""
            progress.update(task, advance=1, description=(
                f"mean |d| {report.metrics.get(K.ABS_DIFF_MEAN, float('nan')):.2g}{kl}  reward {reward:.3f}{skipped}{held}"))

        result = loop.run(on_step)
    found.update(quarantine=opts.quarantine, touched=touched, quarantined=quarantined, reach=reach,
                 rewards=list(result.rewards))
    found.update(halted=result.halted, reason=result.reason, dump=result.dump_dir, steps_run=result.steps_run,
                 alarms=[a for r in result.reports for a in r.alarms], timings=result.timings,
                 error=result.error, restarts=result.restarts, last=result.reports[-1].metrics if result.reports else {})


def _print_found(found: dict[str, Any], console: Any) -> None:
    console.rule("what rlcheck found")
    fault = found["fault"]
    console.print(f"injected: {fault.describe()} ({fault.shape})" + found["reach"].said(fault, found["steps_run"]))
    if found["timings"]:
        med = {p: statistics.median(t.get(p, 0.0) for t in found["timings"]) for p in (*PHASES, "total")}
        console.print("median seconds per step: " + ", ".join(f"{p} {v:.3f}" for p, v in med.items()))
    periodic = [a for a in found["alarms"] if a.kind == "periodic"]
    weights = [a for a in found["alarms"] if a.kind == "weights"]
    if weights:
        a = weights[0]
        where = f"; decoder layers {a.details['layers']}" if a.details.get("layers") else ""
        console.print(f"[bold green]found[/] at step {a.step}: weights the engine should not have had{where}")
    elif periodic:
        a = periodic[0]
        console.print(f"[bold green]found[/]: spikes every {a.details['period']} steps, phase {a.details['phase']}, "
                      f"at step {a.step}; next expected at step {a.details['next_expected']}")
    elif not found["alarms"]:
        console.print(f"[bold green]healthy[/]: {found['steps_run']} steps, no alarm"
                      + found["reach"].unseen(fault, found.get("last", {}).get(K.FLOOR_LEVEL)))
    turns = [(t, found["last"][K.turn_metric(t, "abs_diff_mean")]) for t in range(K.TURN_MAX_INDEX + 1)
             if found.get("last", {}).get(K.turn_metric(t, "tokens"))]
    if turns:  # a multi-turn task: the last step, turn by turn
        console.print("last step's mean |d| by turn: " + ", ".join(f"turn {t} {v:.2g}" for t, v in turns))
    if found.get("quarantine"):
        q, t = set(found["quarantined"]), found["touched"]
        by_reason = Counter(found["quarantined"].values())
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(by_reason.items())) or "none"
        line = f"quarantined {len(q)} sequence(s) ({reasons}) over {found['steps_run']} steps"
        if isinstance(fault, CorruptSequences):
            rest = " (the others within the catastrophic level of the trainer's logprobs)" if q & t != t else ""
            line += (f"; of the {len(t)} the fault corrupted, {len(q & t)} quarantined{rest}, "
                     f"{len(q - t)} healthy ones quarantined")
        console.print(line + f"; their sequences: {found['run_dir'] / 'quarantine'}")
    wandb_runs = sorted(found["run_dir"].glob("wandb/*run-*"))
    if wandb_runs:
        console.print(f"W&B run: {wandb_runs[-1]} (`wandb sync` it to upload)")
    for r in found.get("restarts") or ():
        console.print(f"[yellow]engine restarted[/] at step {r.step} ({r.phase}: {r.cause}) in {r.seconds:.1f} s, "
                      f"weights version {r.weight_version}")
    if found["halted"]:
        console.print(f"halted after {found['steps_run']} steps: {found['reason']}")
        if found.get("dump"):
            console.print(f"evidence: {found['dump']}")
    from rlcheck.forensics.diagnose import diagnose

    verdict = diagnose(found["run_dir"]).verdict
    found["diagnosis"] = verdict
    console.print(f"diagnose: {verdict.title} (confidence {verdict.confidence:.2f}); "
                  f"`rlcheck diagnose {found['run_dir']}` for the evidence")


class Reach:
    """What an injected fault touched over a run: sequences, their tokens and the steps (from the loop's
    `fault_touched`, counted in each step's batch)."""

    def __init__(self) -> None:
        self.sequences = self.tokens = self.total = 0
        self.steps: list[int] = []

    def add(self, step: int, report: StepReport, ids: Any) -> None:
        batch, hit = report.batch, set(ids)
        self.total += 0 if batch is None else batch.num_sequences
        if not hit or batch is None:
            return
        lens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
        rows = [i for i, rid in enumerate(batch.request_ids) if rid in hit]
        self.sequences += len(rows)
        self.tokens += int(lens[rows].sum())
        self.steps.append(step)

    def said(self, fault: Fault, steps_run: int) -> str:
        """The summary line's tail: what the fault touched, or that it touched nothing."""
        if fault.name == "none":
            return ""
        if not self.sequences:
            return (f"; it touched nothing in {steps_run} step(s): no sequence was changed by it, so this run says "
                    "nothing about catching it")
        steps = f"step {self.steps[0]}" if len(self.steps) == 1 else f"{len(self.steps)} steps, {self.steps[0]}-{self.steps[-1]}"
        return f"; it touched {self.sequences} of {self.total} sequences ({self.tokens} tokens) on {steps}"


    def unseen(self, fault: Fault, level: float | None) -> str:
        """Why a fault that touched sequences raised no alarm on a run judged above the fp32 floor ("" otherwise)."""
        if fault.name == "none" or not self.sequences or not level or level <= LEVELS["float32"]:
            return ""
        return (f"; what the fault did to {self.sequences} sequences stayed within the engine's precision noise (judged "
                f"at its floor, {level:g}): --engine-dtype float32 judges the run at the fp32 floor")


def demo_succeeded(found: dict[str, Any]) -> bool:
    """With --quarantine, a sequence-corrupting data fault (corrupt-seqs) runs to the end, quarantining
    no sequence the fault left alone. Otherwise a clean demo raises no alarm; an injected sync fault (skip-sync, stale-weights, drop-sync,
    stale-buffer) ends in a halt on a `weights` alarm (or, for skip-sync with `weights` out of the
    halting kinds, a periodic one of the injected period); any other fault raises an alarm once it acts. A
    fault that touched no sequence (stop-token on a model that never stops) did not succeed."""
    fault = found["fault"]
    if found.get("error") is not None:  # an actor was lost: the demo did not show what it should
        return False
    if fault.name != "none" and found.get("reach") is not None and not found["reach"].sequences:
        return False  # a fault that touched nothing shows nothing
    kinds = {a.kind for a in found["alarms"]}
    if found.get("quarantine") and isinstance(fault, CorruptSequences):
        # corrupt-seqs: the run goes on to its end and quarantines only sequences the fault corrupted (on
        # a confident model most corruptions, logprob ~0 for near-certain tokens, stay near the truth)
        return not found["halted"] and set(found["quarantined"]) <= found["touched"]
    if fault.cause == "weights_out_of_sync":
        periods = [a.details.get("period") for a in found["alarms"] if a.kind == "periodic"]
        return found["halted"] and ("weights" in kinds or (isinstance(fault, SkipSync) and fault.every in periods))
    if fault.name == "none":
        return not found["alarms"]
    return any(a.step >= fault.start for a in found["alarms"])
