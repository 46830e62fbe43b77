"""What `rlcheck demo` says an injected fault touched (`rlcheck.demo.run.Reach`), and that a fault which
touched nothing is no successful demo."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.demo.run import Reach, demo_succeeded
from rlcheck.faults import parse_inject


def report(lengths, step=0):
    batch = StepBatch.from_ragged(logp_rollout=[np.zeros(n) for n in lengths], logp_train=[np.zeros(n) for n in lengths],
                                  request_ids=[f"s{step}-{i}" for i in range(len(lengths))])
    return SimpleNamespace(batch=batch, step=step)


class TestReach:
    def test_counts_sequences_tokens_and_steps(self):
        """Two steps: the touched sequences, their tokens, the first and last step touched, of all sequences seen."""
        reach = Reach()
        reach.add(0, report([3, 4, 5], 0), [])
        reach.add(1, report([3, 4, 5], 1), ["s1-0", "s1-2"])
        reach.add(2, report([2, 2], 2), ["s2-1"])
        said = reach.said(parse_inject("stale-state"), 3)
        assert (reach.sequences, reach.tokens, reach.steps) == (3, 10, [1, 2])
        assert said == "; it touched 3 of 8 sequences (10 tokens) on 2 steps, 1-2"

    def test_touching_nothing_is_said_plainly_and_fails_the_demo(self):
        """A fault that touched no sequence says so, and the demo does not count as a success; no fault, no line."""
        reach = Reach()
        reach.add(0, report([3, 3]), [])
        fault = parse_inject("stop-token")
        assert "touched nothing in 10 step(s)" in reach.said(fault, 10)
        found = {"fault": fault, "reach": reach, "error": None, "alarms": [SimpleNamespace(kind="threshold", step=0)],
                 "halted": False}
        assert not demo_succeeded(found)
        assert Reach().said(parse_inject(None), 5) == ""

    def test_a_fault_within_the_floor_says_so(self):
        """A fault that touched sequences and raised no alarm on a bf16-floored run says it stayed within the engine's
        noise and how to judge at the fp32 floor; on a fp32 run, with no fault, or touching nothing, nothing is added."""
        reach = Reach()
        reach.add(0, report([3, 3]), ["s0-1"])
        fault = parse_inject("left-pad-positions")
        said = reach.unseen(fault, 1e-2)
        assert "1 sequences stayed within the engine's precision noise" in said and "--engine-dtype float32" in said
        assert reach.unseen(fault, 1e-5) == "" and reach.unseen(parse_inject(None), 1e-2) == ""
        assert Reach().unseen(fault, 1e-2) == "" and reach.unseen(fault, None) == ""
