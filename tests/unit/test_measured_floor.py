"""The floor a step of a bf16 engine is judged at, measured by the trainer (`rlcheck.core.floors`,
`rlcheck.loop.floor_sample`): a recorded healthy run of the tiny trained MoE with a bf16 engine on an AVX512-BF16
CPU, 2-12x the bf16 level (tests/data/loop_runs/moe-bf16-healthy-s1: `benchmarks/bench_pad_floor.py --model
moe-trained --seeds 1 --precision bf16`, 12 steps of the hf trainer, every step dumped, each record with the
trainer's own bf16 noise on its tokens, `rlcheck/floor/measured`; recorded while `floor/level` logged the step's
judged level, now the precision's 0.01 as the Monitor logs it), its steps observed again by a fresh Monitor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.run.dump_read import read_dump

RUN = Path(__file__).resolve().parents[1] / "data" / "loop_runs" / "moe-bf16-healthy-s1"


def recorded(off: float = 0.0, start: int = 0) -> list[tuple[StepBatch, float]]:
    """Each step's batch (from its dump; from step `start` on, the engine's logprobs `off` nats lower, at most 0)
    and the floor the trainer measured on it."""
    records = [json.loads(x) for x in (RUN / "metrics.jsonl").read_text().splitlines()]
    out = []
    for rec in records:
        rows, _ = read_dump(RUN / "dumps" / f"step_{rec['step']:06d}")
        batch = StepBatch.from_ragged(logp_rollout=[np.minimum(r["logp_rollout"] - off * (rec["step"] >= start), 0.0)
                                                    for r in rows],
                                      logp_train=[r["logp_train"] for r in rows],
                                      request_ids=[r["request_id"] for r in rows])
        out.append((batch, rec["metrics"][K.FLOOR_MEASURED]))
    return out


def replay(tmp_path: Path, samples: bool, off: float = 0.0, start: int = 0) -> list[list]:
    """The alarms of each recorded step, observed with the trainer's samples or without; `off`: nats the engine's
    logprobs are moved down on every token from step `start` (a fault on top of the run's own noise)."""
    cfg = MonitorConfig(run_dir=tmp_path, sinks=(), precision=Precision("bfloat16", "float32"))
    with Monitor(cfg) as mon:
        out = []
        for step, (batch, sample) in enumerate(recorded(off, start)):
            out.append(mon.observe(step, batch, floor_sample=sample if samples else None).alarms)
        return out


def test_the_recorded_run_sits_above_the_bf16_level():
    """What the recording is: 12 steps, the trainer's measure 0.018-0.098, at least the bf16 level on every step."""
    samples = [s for _, s in recorded()]
    assert len(samples) == 12 and min(samples) >= 1e-2 and max(samples) > 0.05


def test_healthy_at_its_measured_floor(tmp_path):
    """Judged at the bf16 level the healthy run warns (what it did before the trainer measured its floor: false
    alarms on 2 of 2 healthy runs); judged at the floor its trainer measured, step by step, it raises nothing."""
    assert any(replay(tmp_path / "level", samples=False))
    assert replay(tmp_path / "measured", samples=True) == [[]] * 12


@pytest.mark.parametrize("start", [0, 7])
def test_a_fault_above_the_measured_floor_still_alarms(tmp_path, start):
    """The engine 0.3 nats lower on every token from step 0, or from step 7 (the run's noisiest, its trainer's
    measure 0.098): alarmed at that step, at the measured floor, and not before."""
    alarms = replay(tmp_path, samples=True, off=0.3, start=start)
    assert alarms[start] and not any(alarms[:start])


def test_diagnose_reads_the_measured_floor(tmp_path):
    """Diagnose judges the run at the floor its records carry: the median of the trainer's samples (the run's
    level, 0.050 here), each step past a gate only at its own measured level, so the healthy run is healthy and
    no step stands past its gates; the same records without the samples put 11 of 12 steps past the bf16 gates
    (what diagnose read before)."""
    import shutil

    from rlcheck.forensics.diagnose import diagnose
    from rlcheck.forensics.diagnose.evidence import load_evidence
    from rlcheck.forensics.diagnose.floors import elevated_steps, floor_level

    samples = [s for _, s in recorded()]
    ev = load_evidence(RUN)
    assert floor_level(ev) == pytest.approx(float(np.median(samples))) and elevated_steps(ev) == []
    assert diagnose(RUN).healthy
    bare = tmp_path / "bare"
    shutil.copytree(RUN, bare)
    records = [json.loads(x) for x in (bare / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r["metrics"].pop(K.FLOOR_MEASURED)
    (bare / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ev = load_evidence(bare)
    assert floor_level(ev) == 1e-2 and len(elevated_steps(ev)) >= 6
