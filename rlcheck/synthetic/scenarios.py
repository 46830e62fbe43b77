"""Named field scenarios (healthy runs as the field has them) and a runner that feeds one through a
real `Monitor`, counting its alarms and halts: what `benchmarks/bench_field.py` tabulates and the
tests check, on seeds of their own.

    result = run_scenario(SCENARIOS["bf16-long-cot"], seed=100, run_dir=tmp)
    result.halts, result.warn_steps, result.first_alarm(after=onset)

Seeds: defaults were set on `CALIBRATION_SEEDS`; the benchmark reports `HELD_OUT_SEEDS`; the test
suite uses `TEST_SEEDS`. No default may be tuned on the last two.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from rlcheck.errors import MismatchHalt
from rlcheck.synthetic.field import FieldConfig, FieldFault, FieldStream

CALIBRATION_SEEDS = (0, 1, 2)
HELD_OUT_SEEDS = (100, 101, 102, 103, 104)
TEST_SEEDS = (200, 201)


@dataclass(frozen=True)
class Scenario:
    name: str
    field: FieldConfig
    num_steps: int
    """Observations in the run."""
    description: str
    restart_at: tuple[int, ...] = ()
    """Observations at which the process restarts: the Monitor is closed and a new one resumes."""
    rewind: int = 0
    """A restart resumes from a checkpoint this many observations back (those steps come again)."""


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("bf16-short", FieldConfig(num_sequences=64, median_length=200, length_sigma=0.7, growth=2.0,
                                           level_ar=0.12),
                 1000, "bf16 engine, 64 short responses (median 200 tokens) a step, floor 1e-3 doubling over "
                       "2,000 steps, step autocorrelation as measured here (0.12)"),
        Scenario("bf16-long-cot", FieldConfig(num_sequences=24, median_length=2000, growth=10.0, growth_steps=2400),
                 2400, "long chain-of-thought: 24 responses of median 2,000 tokens (up to 32k), floor 1e-3 -> 1e-2 over 2,400 steps"),
        Scenario("gapped", FieldConfig(num_sequences=24, median_length=900, step_stride=2, growth=10.0, growth_steps=3000),
                 1200, "TRL with num_iterations=2: steps 0, 2, 4, ..., 24 responses of median 900 tokens, floor growing 10x over 3,000 steps"),
        Scenario("two-ranks", FieldConfig(num_sequences=12, num_ranks=2, median_length=900, growth=5.0),
                 1500, "two trainer ranks of 12 responses each (median 900 tokens), per-rank level offsets, reduced across ranks"),
        Scenario("resumed", FieldConfig(num_sequences=24, median_length=900, growth=5.0),
                 1400, "restarts at observations 500 and 1000, each resuming from a checkpoint 20 steps back (steps repeat)",
                 restart_at=(500, 1000), rewind=20),
        Scenario("long-cot-growing", FieldConfig(num_sequences=24, median_length=1000, length_growth=4.0,
                                                 confident_frac=0.8, confident_frac_end=0.45, growth=2.0,
                                                 growth_steps=1200),
                 2000, "long chain-of-thought whose mean |d| grows ~5x in 1,200 steps because the responses get "
                       "4x longer and less peaked (near-certain tokens 80% -> 45%; 2.5x of the growth) on a floor "
                       "doubling: growth a drift detector must not call the engine's"),
    )
}

FAULT_BASELINES = ("bf16-short", "bf16-long-cot")
"""The healthy scenarios the fault zoo is laid on."""

FAULTS = (
    FieldFault("skip-sync", onset=300, every=4),
    FieldFault("stale-weights", onset=300),
    FieldFault("off-by-one", onset=300),
    FieldFault("temperature", onset=0, value=1.02),
    FieldFault("temperature", onset=0, value=1.1),
    FieldFault("corrupt-seqs", onset=300, value=1e-3),
    FieldFault("spikes", onset=300, every=12, value=1.5),
    FieldFault("spikes", onset=300, every=12, value=2.0),
)


@dataclass
class ScenarioResult:
    """What the Monitor did over one run of a scenario."""

    scenario: str
    seed: int
    fault: str | None
    steps: list[int] = field(default_factory=list)
    """Step number of each observation, in order (repeats after a rewind included)."""
    alarms: list[list[dict]] = field(default_factory=list)
    """Per observation: its alarms (`Alarm.to_dict()`)."""
    metrics: list[dict[str, float]] = field(default_factory=list)
    halts: list[int] = field(default_factory=list)
    """Observation indices at which the Monitor raised MismatchHalt."""
    onset_observation: int | None = None
    """The first observation the fault touched (`FieldStream.touched`)."""

    def observations_with(self, severity: str) -> list[int]:
        return [i for i, a in enumerate(self.alarms) if any(x["severity"] == severity for x in a)]

    @property
    def warn_steps(self) -> int:
        return len(self.observations_with("warn"))

    def first_alarm(self, after: int = 0, severity: str | None = None) -> int | None:
        """The first observation at or after `after` with an alarm (of `severity` when given)."""
        for i in range(after, len(self.alarms)):
            if any(severity is None or x["severity"] == severity for x in self.alarms[i]):
                return i
        return None


def observation_order(s: Scenario) -> list[int]:
    """The observation indices in the order the run sees them (a rewind repeats some)."""
    order, i, restarts = [], 0, set(s.restart_at)
    while i < s.num_steps:
        if i in restarts:
            restarts.discard(i)
            i = max(0, i - s.rewind)
            order.append(-1)  # restart marker
        order.append(i)
        i += 1
    return order


def run_scenario(s: Scenario, seed: int, run_dir: str | os.PathLike, fault: FieldFault | None = None,
                 monitor_config: Callable | None = None, stop_on_halt: bool = False,
                 keep_metrics: bool = False, whole_batch: bool = False,
                 on_step: Callable | None = None) -> ScenarioResult:
    """Feed the scenario through a `Monitor` (the default config, JSONL sink, in `run_dir`); a halt
    is counted and the run goes on (a new Monitor resumes it, as a restarted trainer's would), unless
    `stop_on_halt`. `monitor_config(run_dir)` overrides the
    config. The ranks' statistics are reduced as across ranks (`observe_partial`), or with
    `whole_batch` their sequences joined and observed at once (`observe`: what a quarantine needs to
    judge them). `on_step(i, batch, report)` sees each observation i (the batch observed, or rank 0's)."""
    from rlcheck.core.batch import StepBatch
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.core.stats import compute_partial, merge

    cfg = (monitor_config or (lambda d: MonitorConfig(run_dir=d, sinks=("jsonl",))))(run_dir)
    stream = FieldStream(dataclasses.replace(s.field, seed=seed), fault, s.num_steps)
    result = ScenarioResult(s.name, seed, fault.name if fault else None)
    mon = Monitor(cfg)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the resume and repeated-step notices
            for i in observation_order(s):
                if i < 0:
                    mon.close()
                    mon = Monitor(cfg)
                    continue
                batches = stream.batches(i)
                batch = StepBatch.concat(batches) if whole_batch else batches[0]
                try:
                    if whole_batch:
                        report = mon.observe(stream.step(i), batch)
                    else:
                        partial = merge([compute_partial(b, cfg.stats) for b in batches])
                        report = mon.observe_partial(stream.step(i), partial, batch)
                except MismatchHalt as halt:
                    report = halt.report
                    result.halts.append(len(result.steps))
                    if not stop_on_halt:  # a halt closes the run: go on as a restarted trainer would
                        mon = Monitor(cfg)
                if on_step is not None:
                    on_step(i, batch, report)
                if fault is not None and result.onset_observation is None and i in stream.touched:
                    result.onset_observation = len(result.steps)
                result.steps.append(stream.step(i))
                result.alarms.append([a.to_dict() for a in report.alarms])
                if keep_metrics:
                    result.metrics.append(report.metrics)
                if result.halts and stop_on_halt:
                    break
    finally:
        mon.close()
    return result
