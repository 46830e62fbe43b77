"""A Monitor in a real subprocess, killed with SIGKILL: at random moments, and exactly between the
metrics.jsonl line and state.json, in the middle of the state write, in the middle of a line, and in
the middle of a halt's dump. After every kill the run directory holds whole lines and a state the
next process resumes from; at the end every step is logged once and the detectors' state equals
that of an uninterrupted run. A live Monitor's lock on its run dir goes with its process, SIGKILL
included: the next Monitor resumes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from rlcheck import HaltConfig, Monitor, MonitorConfig
from rlcheck.core.run.journal import read_jsonl
from rlcheck.errors import RunDirError
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

NUM_STEPS = 60
CFG = dict(num_sequences=32, mean_length=20, spike_every=4, spike_phase=1, spike_start=14, spike_scale=4.0)
"""Spikes every 4th step: robust-z alarms from step 33 and a periodic one by step 57."""

# argv: run_dir, kill_at (-1: never), where (none|between|mid_state|mid_line|mid_dump)
CHILD = f"""
import os, signal, sys
from rlcheck import HaltConfig, Monitor, MonitorConfig, StepBatch
from rlcheck.core.run import dump
from rlcheck.core.run import files as rundir
from rlcheck.core.run.journal import Journal
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

run_dir, kill_at, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = SyntheticConfig(**{CFG!r})

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def half_line(self, data):
    os.write(self._fd, data[: len(data) // 2])
    die()

def after_line(patch):
    real_log = mon.sinks.log
    def log(step, record):
        real_log(step, record)
        patch()
    mon.sinks.log = log

fsyncs = []
def dump_fsync(path):
    fsyncs.append(path)
    if len(fsyncs) == 2:  # sequences.parquet synced, meta.json written: die before the rename
        die()

halt = HaltConfig(enabled=where == "mid_dump")
mon = Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), halt=halt))
start = 0 if mon.last_step is None else mon.last_step + 1
print("start", start, flush=True)
for step in range(start, {NUM_STEPS}):
    batch = synthetic_batch(cfg, step)
    if step == kill_at:
        if where == "between":
            after_line(lambda: setattr(rundir, "atomic_write_json", die))
        elif where == "mid_state":
            after_line(lambda: setattr(os, "replace", die))
        elif where == "mid_line":
            Journal._write = half_line
        elif where == "mid_dump":
            dump._fsync_file = dump_fsync
            batch = StepBatch.from_packed(batch.logp_rollout, batch.logp_train - 2.0, batch.cu_seqlens,
                                          batch.request_ids)
    mon.observe(step, batch)
    print("step", step, flush=True)
mon.close()
print("done", flush=True)
"""


def child(run_dir, kill_at=-1, where="none") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(kill_at), where],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def kill_after(proc: subprocess.Popen, step: int, delay: float) -> None:
    """SIGKILL `proc` `delay` seconds after it printed `step k` for some k >= `step`."""
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= step:
            break
        if line.startswith("done"):
            return
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


def where_it_stopped(run_dir) -> str:
    """Which writes of the step in flight were on disk: 'line+state', 'line only' or 'none'."""
    state = json.loads((run_dir / "state.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    last_line = records[-1]["step"] if records else None
    torn = " (torn line)" if records.num_skipped else ""
    return ("line only" if last_line != state["last_step"] else "line+state") + torn


def reference_state(tmp_path) -> dict:
    cfg = SyntheticConfig(**CFG)
    mon = Monitor(MonitorConfig(run_dir=tmp_path / "reference", sinks=("jsonl",), halt=HaltConfig(enabled=False)))
    for step in range(NUM_STEPS):
        mon.observe(step, synthetic_batch(cfg, step))
    return json.loads((tmp_path / "reference" / "state.json").read_text())


def assert_complete(run_dir, tmp_path, max_torn: int) -> None:
    """Every step once, only whole lines (torn ones counted), state at the end, detectors as uninterrupted."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    assert len([x for x in lines if x.strip()]) == len(records) + records.num_skipped
    assert records.num_skipped <= max_torn
    state = json.loads((run_dir / "state.json").read_text())
    want = reference_state(tmp_path)
    assert state["last_step"] == NUM_STEPS - 1
    assert (state["detectors"], state["alarm_counts"]) == (want["detectors"], want["alarm_counts"])
    assert {"robust_z", "periodic"} <= set(state["alarm_counts"])
    assert sorted(os.listdir(run_dir)) == [".lock", "metrics.jsonl", "state.json"]


@pytest.mark.slow
class TestSigkill:
    def test_random_kills(self, tmp_path):
        """Five SIGKILLs at random moments (0-4 ms after a printed step), each followed by a resume."""
        rng = random.Random(8)
        run_dir = tmp_path / "run"
        stops = []
        next_step = 0
        for _ in range(5):
            kill_after(child(run_dir), next_step + rng.randint(3, 9), rng.uniform(0.0, 0.004))
            stops.append(where_it_stopped(run_dir))
            next_step = json.loads((run_dir / "state.json").read_text())["last_step"] + 1
        code, out, err = finish(child(run_dir))
        assert code == 0 and "done" in out, err[-2000:]
        assert_complete(run_dir, tmp_path, max_torn=5)
        print("random kills stopped at:", stops)

    @pytest.mark.parametrize("where, k", [("between", 40), ("mid_state", 40), ("mid_line", 40), ("between", 0)])
    def test_kill_at_each_write(self, tmp_path, where, k):
        """A SIGKILL at step k exactly between the line and the state, inside the state write, or halfway
        through a line: the run resumes and ends with every step once and the detectors of an unbroken run."""
        run_dir = tmp_path / "run"
        code, _, _ = finish(child(run_dir, kill_at=k, where=where))
        assert code == -signal.SIGKILL
        records = read_jsonl(run_dir / "metrics.jsonl")
        state = json.loads((run_dir / "state.json").read_text())
        assert state["last_step"] == (k - 1 if k else None)
        line_on_disk = where != "mid_line"
        assert [r["step"] for r in records][-1:] == ([k] if line_on_disk else [k - 1])
        assert records.num_skipped == (not line_on_disk)
        code, out, err = finish(child(run_dir))
        assert code == 0, err[-2000:]
        assert out.splitlines()[0] == f"start {k + 1 if line_on_disk else k}"
        assert (f"held step(s) [{k}]" in err) == line_on_disk and ("cut short" in err) == (not line_on_disk)
        assert_complete(run_dir, tmp_path, max_torn=int(not line_on_disk))

    def test_kill_mid_dump(self, tmp_path):
        """A SIGKILL while the halting step's dump is written leaves no dump a reader could take as
        complete; the step's line and state are on disk, and the next Monitor clears the temp dir."""
        run_dir = tmp_path / "run"
        code, _, err = finish(child(run_dir, kill_at=3, where="mid_dump"))
        assert code == -signal.SIGKILL, err[-2000:]
        dumps = sorted(p.name for p in (run_dir / "dumps").iterdir())
        assert len(dumps) == 1 and dumps[0].startswith(".step_000003.")
        assert sorted(os.listdir(run_dir / "dumps" / dumps[0])) == ["meta.json", "sequences.parquet"]
        assert json.loads((run_dir / "state.json").read_text())["last_step"] == 3
        assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
        Monitor(MonitorConfig(run_dir=run_dir, sinks=()))
        assert list((run_dir / "dumps").iterdir()) == []


HOLDER = f"""
import sys, time
from rlcheck import Monitor, MonitorConfig
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

mon = Monitor(MonitorConfig(run_dir=sys.argv[1], sinks=("jsonl",)))
mon.observe(0, synthetic_batch(SyntheticConfig(**{CFG!r}), 0))
print("holding", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
class TestLockAcrossProcesses:
    def test_sigkilled_holder_frees_the_run_dir(self, tmp_path):
        """While a live Monitor in another process holds the run dir, a Monitor here is refused naming
        its pid; once that process is SIGKILLed (no close), a Monitor here resumes after its step."""
        run_dir = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line.strip() == "holding", proc.stderr.read()[-2000:]
            with pytest.raises(RunDirError, match=rf"in use by another live Monitor \(pid {proc.pid} "):
                Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",)))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        with pytest.warns(UserWarning, match="resume after step 0"), \
                Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
            mon.observe(1, synthetic_batch(SyntheticConfig(**CFG), 1))
        records = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1] and records[1]["resumed"] == {"after_step": 0, "count": 1}
