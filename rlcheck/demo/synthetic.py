"""`rlcheck demo --synthetic`: the monitor over a realistic synthetic stream with a periodic spike injected.

The stream (`rlcheck.synthetic`) is clean for `spike_start` steps, then every `period`-th step its
numeric noise grows by 40%: a few MAD of mean |d|, far below any absolute threshold, the shape a
weight sync skipped every P steps leaves. The periodic detector should name the period and phase and
halt the run with a dump; the demo then prints what was found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import MismatchHalt
from rlcheck.synthetic import SyntheticConfig, is_spike, synthetic_batch


def run_demo(run_dir: Path, steps: int, period: int, spike_start: int, seed: int, sinks: tuple[str, ...],
             console: Any) -> dict[str, Any]:
    """Run the synthetic demo; returns what it found (also printed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    data = SyntheticConfig(spike_every=period, spike_start=spike_start, seed=seed)
    cfg = MonitorConfig(run_dir=run_dir, sinks=sinks, resume=False,
                        context={"source": "rlcheck.synthetic", "synthetic": data.__dict__})
    found: dict[str, Any] = {"halted": False, "steps_run": 0, "alarms": []}
    columns = (TextColumn("[bold]rlcheck demo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Monitor(cfg) as mon, Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("", total=steps)
        for step in range(steps):
            batch = synthetic_batch(data, step)
            try:
                report = mon.observe(step, batch)
            except MismatchHalt as halt:
                report = halt.report
                found.update(halted=True, reason=halt.reason, dump=halt.dump_dir)
            found["steps_run"] = step + 1
            for a in report.alarms:
                found["alarms"].append(a)
                progress.console.print(f"[yellow]step {step}[/] {a.kind}/{a.severity}: {a.message}")
            mark = " (spike injected)" if is_spike(data, step) else ""
            progress.update(task, advance=1, description=f"mean |d| {report.metrics[K.ABS_DIFF_MEAN]:.3g}{mark}")
            if found["halted"]:
                break
    _print_found(found, data, console)
    return found


def _print_found(found: dict[str, Any], data: SyntheticConfig, console: Any) -> None:
    console.rule("what rlcheck found")
    console.print(f"injected: a spike every {data.spike_every} steps from step {data.spike_start} "
                  f"(steps = {data.spike_phase % data.spike_every} mod {data.spike_every})")
    periodic = [a for a in found["alarms"] if a.kind == "periodic"]
    if periodic:
        a = periodic[0]
        first_spike = next(s for s in range(data.spike_start, data.spike_start + data.spike_every)
                           if is_spike(data, s))
        console.print(
            f"[bold green]found[/]: period {a.details['period']}, phase {a.details['phase']} at step {a.step}, "
            f"{(a.step - first_spike) // data.spike_every} periods after the first spike; "
            f"next spike expected at step {a.details['next_expected']}"
        )
    else:
        console.print("[bold red]no periodic alarm[/]")
    if found["halted"]:
        console.print(f"halted after {found['steps_run']} steps: {found['reason']}")
        console.print(f"evidence: {found['dump']}")
