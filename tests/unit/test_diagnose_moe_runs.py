"""Diagnose on recorded runs of `rlcheck demo`'s loop on the tiny trained MoE (tests/data/loop_runs, written by
`benchmarks/bench_confusion.py`, seed 1, fp32 engine and trainer): `moe-route-flip=0.1` reroutes near-tie tokens
inside the engine, prompt tokens included, so one prompt's samples are scored apart (split twins) while the
rerouted response tokens carry only part of the mismatch (0.13, 0.90 and 0.026 of steps 0-2); it was named
"token misalignment" (the split twins on a model without state). `corrupt-seqs=0.03` splits twins with the routing
in agreement on every token: not the routing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rlcheck.forensics.diagnose import diagnose

RECORDED = Path(__file__).resolve().parents[1] / "data" / "loop_runs"
FLIP, CORRUPT = "moe-fp32-route-flip-s1", "moe-fp32-corrupt-seqs-s1"


def test_split_twins_with_the_routing_apart_are_the_routing():
    """fp32 both sides, 1.3-2.9% of the response tokens rerouted on the split steps: moe_routing, with the fix."""
    v = diagnose(RECORDED / FLIP).verdict
    assert (v.cause, v.affected_steps[0]) == ("moe_routing", 0), (v.cause, v.evidence)
    text = " ".join(v.evidence)
    assert "qwen3_moe" in text and "routing replay" in text and "up to 2.9%" in text


def test_split_twins_with_the_routing_in_agreement_are_not():
    """The routing agreed on every token: the split twins say the engine was given other ids (0.6), as before."""
    v = diagnose(RECORDED / CORRUPT).verdict
    assert v.cause == "token_misalignment" and v.confidence == 0.6, (v.cause, v.evidence)


def test_a_rerouted_token_under_a_bf16_engine_is_no_evidence(tmp_path):
    """The route-flip records judged at a bf16 engine's floor (where 0-5% of the tokens reroute from rounding
    alone): the split twins are not put on the routing."""
    run = tmp_path / FLIP
    shutil.copytree(RECORDED / FLIP, run)
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["metrics"]["rlcheck/floor/level"] = 0.01
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert diagnose(run).verdict.cause != "moe_routing"
