"""Diagnose on a multi-turn batch handed over without the engine's per-call prompts (turns from the loss
mask's runs, as verl's agent loop and OpenRLHF hand them over), on rows shaped after the recorded ones
(`benchmarks/bench_confusion_turns.py --mask-only`, seed 0: BENCHMARKS.md "Without the engine's per-call
prompts"): the trainer scores the conversation as rendered last, so history rendered otherwise puts the
rows off in an earlier turn and leaves the last turn clean. Stripped history (a `<think>` dropped at a
turn's start) puts every row off from turn 0's first token, with a 0.0 at the shorter trained turn's end:
`stripped_history`, not `join_token_mask`; re-tokenized history a third of the rows, inside the text (offsets
3 to 26), its identical trained prefixes scored apart by the engine: `retokenized_history`, not
`stale_state` on a Llama. A real join token, a turn's logprobs missing and a healthy batch keep theirs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import MismatchHalt
from rlcheck.forensics.diagnose import diagnose

TURNS, TOOL = (14, 14, 30), 10
"""Three model turns, tool replies of 10 tokens between them (the calculator model's stripped rows' lengths)."""
PROMPTS, SAMPLES = 8, 8
STATE = {"stale_state", "index_aliasing"}


def rows(fault: str, seed: int = 0) -> StepBatch:
    """64 rows (8 prompts x 8 samples, a prompt's samples alike up to the fault), turns from the mask's runs."""
    rng = np.random.default_rng(seed)
    lr_, lt_, tok_, mask_, ids = [], [], [], [], []
    base = [(rng.uniform(-2.0, -0.01, n), rng.integers(10, 500, n)) for n in TURNS]
    for p in range(PROMPTS):
        for s in range(SAMPLES):
            i = p * SAMPLES + s
            lr, lt, tok, mask = [], [], [], []
            for t, (logp, ids_) in enumerate(base):
                e, r = logp.copy(), logp + rng.normal(0, 1e-7, logp.size)
                if fault == "stripped" and t < 2:  # the engine's longer turn laid onto the shorter trained one
                    r = -rng.uniform(0.0, 20.0, logp.size)
                    r[0] = -19.9
                    if t == 0 and p == 2:  # the engine's sure token laid on the trained turn's end
                        e[-1], r[-1] = 0.0, -9.3
                if fault == "retokenized" and t == i % 2 and i % 3 == 0:  # a third of the rows, inside the text
                    at = 3 + (i * 7) % 20
                    r[at:at + 4] = e[at:at + 4] - np.array([3.09, 0.19, 12.05, 18.7])[: r[at:at + 4].size]
                if fault == "join" and t < 2:  # a join token in the loss with a made-up 0.0
                    e[-1], r[-1] = 0.0, -6.0
                if fault == "missing" and t == 1 and p % 3 == 0:  # turn 1's logprobs filled with 0.0
                    e[:], r[:] = 0.0, np.minimum(logp, -0.5)
                lr.append(e), lt.append(np.minimum(r, 0.0)), tok.append(ids_), mask.append(np.ones(ids_.size, bool))
                if t < len(TURNS) - 1:
                    lr.append(np.zeros(TOOL)), lt.append(-rng.exponential(4.0, TOOL))
                    tok.append(rng.integers(10, 500, TOOL)), mask.append(np.zeros(TOOL, bool))
            lr_.append(np.concatenate(lr)), lt_.append(np.concatenate(lt))
            tok_.append(np.concatenate(tok)), mask_.append(np.concatenate(mask)), ids.append(f"r{p}_{s}")
    prompts = [np.arange(1, 9) + (i // SAMPLES) for i in range(len(ids))]
    return StepBatch.from_ragged(lr_, lt_, ids, tok_, mask=mask_, prompt_tokens=prompts, turns="mask_runs")


def record(tmp_path, fault: str, seed: int = 0) -> None:
    """Four clean steps, the fault at step 4 (a halt or the first alarm's dump), a Llama in the context."""
    cfg = MonitorConfig(run_dir=tmp_path, sinks=(), precision=Precision("float32", "float32"),
                        context={"model": "runs/models/llama-calculator", "model_type": "llama"})
    with Monitor(cfg) as mon:
        for step in range(5):
            batch = rows(fault if step == 4 else "none", seed=seed * 10 + step)
            try:
                report = mon.observe(step, batch)
            except MismatchHalt:
                return
            if report.alarms and not list(tmp_path.glob("dumps/step_*")):
                mon.dump(step, batch, report, reason="first alarm")


@pytest.mark.parametrize("seed", [0, 2])
class TestRewrittenHistory:
    def test_stripped_history_is_not_a_join_token(self, tmp_path, seed):
        record(tmp_path, "stripped", seed)
        d = diagnose(tmp_path)
        assert (d.verdict.cause, d.verdict.confidence) == ("stripped_history", 0.85), d.findings
        text = " ".join(d.verdict.evidence)
        assert "first token" in text and "not a join token" in text and "prompt_ids" in text
        assert not {f.cause for f in d.findings} & STATE

    def test_retokenized_history_is_not_stale_state(self, tmp_path, seed):
        record(tmp_path, "retokenized", seed)
        d = diagnose(tmp_path)
        assert (d.verdict.cause, d.verdict.confidence) == ("retokenized_history", 0.85), d.findings
        assert "inside a turn" in " ".join(d.verdict.evidence)
        assert not {f.cause for f in d.findings} & STATE

    def test_the_other_turn_faults_keep_their_names(self, tmp_path, seed):
        record(tmp_path / "join", "join", seed)
        assert diagnose(tmp_path / "join").verdict.cause == "join_token_mask"
        record(tmp_path / "missing", "missing", seed)
        assert diagnose(tmp_path / "missing").verdict.cause == "turn_logprobs_missing"
        record(tmp_path / "none", "none", seed)
        assert diagnose(tmp_path / "none").verdict.cause == "healthy"


def test_with_the_per_call_prompts_the_rows_do_not_decide(tmp_path):
    """The same stripped rows in a dump whose turns were given per call: the row shape is not read (the prefix
    invariant, which those prompts feed, says it directly)."""
    record(tmp_path, "stripped")
    for meta in tmp_path.glob("dumps/*/meta.json"):
        m = json.loads(meta.read_text())
        meta.write_text(json.dumps({**m, "turns": {**m["turns"], "source": "explicit"}}))
    assert diagnose(tmp_path).verdict.cause != "stripped_history"
