"""The cross-turn invariants (`rlcheck.core.turn_checks`) and the Monitor's use of them
(`rlcheck.core.turn_alarms`): each breach an alarm with its evidence and the row quarantined, never a
silent pass; stale turns masked; nothing on healthy trajectories or batches without turns."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.turn_checks import TurnCheckConfig, check, classify
from rlcheck.core.turns import JoinEdits, TurnRecord
from rlcheck.core.turns_build import Trajectory, Turn
from rlcheck.errors import MismatchHalt
from rlcheck.faults.turns import (
    JoinTokenMask,
    MissingGenerationPrompt,
    RetokenizedHistory,
    StaleTurn,
    StrippedHistory,
    ToolTokensInLoss,
    TurnLogprobsMissing,
)
from rlcheck.synthetic.field import FieldConfig
from rlcheck.synthetic.turns import MultiTurnConfig, MultiTurnStream

SMALL = MultiTurnConfig(field=FieldConfig(num_sequences=6, seed=4), first_length=60, turn_length=12,
                        observation_length=8)


def stream_batch(fault=None, mask_runs: bool = False, step: int = 3):
    s = MultiTurnStream(dataclasses.replace(SMALL, mask_runs=mask_runs), fault=fault, num_steps=10)
    return s.batch(step), s.trainer_version(step)


def broken(batch, version, **kw) -> dict[str, int]:
    v = check(batch, TurnCheckConfig(**kw), trainer_version=version)
    return {k: int(f.sum()) for k, f in v.broken.items() if f.any()}


class TestInvariants:
    def test_healthy_trajectories_break_nothing(self):
        """Token-in/token-out trajectories on-policy: no breach, explicit or from mask runs."""
        for mask_runs in (False, True):
            b, v = stream_batch(mask_runs=mask_runs)
            assert broken(b, v) == {}

    def test_retokenized_history(self):
        """A later call's prompt re-tokenizes turn 0's output: a prefix break inside it, ids replaced."""
        b, v = stream_batch(RetokenizedHistory())
        verdict = check(b, trainer_version=v)
        assert verdict.broken["prefix_break"].all()
        e = verdict.evidence["prefix_break"][0]
        assert (e["call"], e["in"], e["turn"], e["edit"]["kind"]) == (1, "output", 0, "replaced")
        assert e["expected"] != e["actual"] and e["offset"] >= 1

    def test_stripped_history(self):
        """Turn 0's first tokens missing from later prompts: the break at offset 0, ids deleted."""
        b, v = stream_batch(StrippedHistory())
        e = check(b, trainer_version=v).evidence["prefix_break"][0]
        assert (e["in"], e["turn"], e["offset"], e["edit"]) == ("output", 0, 0, {"kind": "deleted", "removed": 16,
                                                                                   "added": 0})

    def test_missing_generation_prompt(self):
        """The trained ids before turn 1 lack the header the engine had: the break at turn 1, offset 0."""
        b, v = stream_batch(MissingGenerationPrompt())
        e = check(b, trainer_version=v).evidence["prefix_break"][0]
        assert (e["call"], e["turn"], e["offset"], e["expected"], e["actual"]) == (1, 1, 0, list(SMALL.header), [])
        assert e["edit"]["kind"] == "missing"

    def test_join_token_mask(self):
        """The join token in the loss: a zero logprob at each turn's end, the trained turn one longer."""
        b, v = stream_batch(JoinTokenMask())
        verdict = check(b, trainer_version=v)
        assert verdict.broken["zero_logprobs"].all() and verdict.broken["logprob_count"].all()
        z = verdict.evidence["zero_logprobs"][0]
        assert z["at_turn_end"] and z["length"] == 1
        c = verdict.evidence["logprob_count"][0]
        assert c["trained_tokens"] == c["sampled"] + 1

    def test_tool_tokens_in_loss(self):
        """Tool tokens in the loss: marked tool yet compared; with mask runs, turns merge (count < framework's)."""
        b, v = stream_batch(ToolTokensInLoss())
        assert set(broken(b, v)) == {"tool_in_loss", "zero_logprobs"}
        b, v = stream_batch(ToolTokensInLoss(), mask_runs=True)
        assert set(broken(b, v)) == {"turn_count", "zero_logprobs"}

    def test_turn_logprobs_missing(self):
        """Zero-filled logprobs: a run of exact zeros inside a turn, the recorded count short."""
        b, v = stream_batch(TurnLogprobsMissing())
        verdict = check(b, trainer_version=v)
        assert set(broken(b, v)) == {"zero_logprobs", "logprob_count"}
        z = verdict.evidence["zero_logprobs"][0]
        assert z["length"] >= 4 and z["trainer_mean_logprob"] > -2
        assert verdict.evidence["logprob_count"][0]["logprobs"] < verdict.evidence["logprob_count"][0]["sampled"]

    def test_stale_turn(self):
        """Early turns of old weights: the stale turns named, their tokens (only) marked for masking."""
        b, v = stream_batch(StaleTurn())
        verdict = check(b, trainer_version=v)
        assert verdict.broken["stale_turn"].all()
        e = verdict.evidence["stale_turn"][0]
        assert e["turns"] and all(e["versions"][k] == v - 2 for k in e["turns"])
        assert verdict.stale_tokens.any() and not (verdict.stale_tokens & b.turns.tool).any()
        assert not verdict.condemned(TurnCheckConfig()).any()
        assert verdict.condemned(TurnCheckConfig(mask_stale_turns=False)).all()

    def test_a_sure_token_is_no_zero_breach(self):
        """An fp32 engine's exact 0.0 on a token the trainer is as sure of (-1e-7) breaks nothing."""
        b, v = stream_batch()
        lr, lt = b.logp_rollout.copy(), b.logp_train.copy()
        runs = b.turns.runs(b.cu_seqlens)
        ends = runs.start + runs.length - 1
        lr[ends], lt[ends] = 0.0, -1e-7
        assert broken(dataclasses.replace(b, logp_rollout=lr, logp_train=lt), v) == {}

    def test_declared_join_edits(self):
        """A stop id the framework removes (GLM) breaks no prefix when declared, and does when not."""
        glm = 99

        def batch(join):
            out0 = [5, 6, glm]
            p1 = [1, 2, 5, 6, 7, 8]  # the stop id dropped from the next prompt
            t0 = Turn(out0, [-0.1] * 3, prompt_ids=[1, 2], observation_ids=[7, 8])
            t1 = Turn([9], [-0.2], prompt_ids=p1)
            n = (3 if join is None else 2) + 3
            return StepBatch.from_turns([Trajectory([t0, t1], logp_train=np.full(n, -0.3))], ["a"], join=join)

        assert "prefix_break" not in broken(batch(JoinEdits(remove_trailing=(glm,))), None)
        assert "prefix_break" in broken(batch(None), None)

    def test_framework_turn_count(self):
        """A framework count that disagrees with the turns found breaks turn_count."""
        b = StepBatch.from_packed(np.full(6, -0.1), np.full(6, -0.1), [0, 6], ["a"], mask=[1, 1, 0, 1, 0, 1],
                                  turns="mask_runs", turn_records=[TurnRecord(num_turns=2)])
        assert broken(b, None) == {"turn_count": 1}

    def test_classify(self):
        e = np.arange(50)
        assert classify(np.concatenate([e[:5], e[9:]]), e, 5)["kind"] == "deleted"
        assert classify(np.concatenate([e[:5], [99], e[7:]]), e, 5) == {"kind": "replaced", "removed": 2, "added": 1}


class TestMonitor:
    def observe(self, tmp_path, batch, version, **cfg):
        with Monitor(MonitorConfig(tmp_path / "run", sinks=(), **cfg)) as mon:
            return mon.observe(0, batch, trainer_version=version)

    def test_quarantined_with_a_warning(self, tmp_path):
        """Quarantine on: each broken invariant a warning with evidence, its rows quarantined (turn_invariant)."""
        b, v = stream_batch(RetokenizedHistory(rate=0.4))
        r = self.observe(tmp_path, b, v, quarantine=QuarantineConfig(max_frac=0.9))
        (a,) = [a for a in r.alarms if a.metric == K.turn_invariant("prefix_break")]
        assert a.severity == "warn" and a.details["signature"] == "turn_prefix_break"
        assert a.details["evidence"][0]["turn"] == 0 and "expected" in a.message
        bad = set(a.details["request_ids"])
        assert {q.request_id for q in r.quarantined} == bad and all(q.reason == "turn_invariant" for q in r.quarantined)
        assert r.metrics[K.turn_invariant("prefix_break")] == len(bad) and r.metrics[K.TURN_COUNT] > 0

    def test_critical_without_quarantine(self, tmp_path):
        """Quarantine off: the invariant's alarm is critical and halts, never a silent pass."""
        b, v = stream_batch(TurnLogprobsMissing())
        with pytest.raises(MismatchHalt) as exc:
            self.observe(tmp_path, b, v)
        assert any(a.severity == "critical" and a.details.get("signature") == "turn_zero_logprobs"
                   for a in exc.value.report.alarms)

    def test_stale_turns_masked_row_kept(self, tmp_path):
        """Stale turns: their tokens masked out of the step (and the loss), the sequence kept; a warning."""
        b, v = stream_batch(StaleTurn())
        r = self.observe(tmp_path, b, v, quarantine=QuarantineConfig())
        (a,) = [a for a in r.alarms if a.metric == K.turn_invariant("stale_turn")]
        assert a.severity == "warn" and a.details["action"] == "masked"
        assert r.keep.all() and r.metrics[K.TURN_MASKED_TOKENS] > 0
        assert np.count_nonzero(r.batch.mask) == np.count_nonzero(b.mask) - r.metrics[K.TURN_MASKED_TOKENS]
        assert (r.token_weights()[~r.batch.mask] == 0).all()

    def test_healthy_and_checks_off(self, tmp_path):
        """Healthy multi-turn steps: no alarm; turn_checks=None: no invariant alarm on a broken one."""
        b, v = stream_batch()
        assert self.observe(tmp_path, b, v).alarms == []
        b, v = stream_batch(JoinTokenMask())
        r = self.observe(tmp_path / "off", b, v, turn_checks=None)
        assert not [a for a in r.alarms if a.metric.startswith(K.TURN_PREFIX + "inv/")]


class TestEpisodeCorrection:
    def test_sequence_level_is_the_per_token_mean(self, tmp_path):
        """On a multi-turn batch the sequence-level IS weight is exp(mean d), not exp(sum d): a steady 0.01 nat
        bias over a long episode keeps weights near 0.99 where the sum would collapse them to ~0."""
        from rlcheck.core.correction import CorrectionConfig
        from rlcheck.core.types import StepReport

        s = MultiTurnStream(dataclasses.replace(SMALL, first_length=2000, turn_length=300), num_steps=2)
        b = s.batch(1)
        b = dataclasses.replace(b, logp_train=np.minimum(b.logp_rollout - 0.01, -1e-9))
        with Monitor(MonitorConfig(tmp_path / "r", sinks=(), correction=CorrectionConfig(rollout_is="sequence"))) as mon:
            r = mon.observe(0, b, trainer_version=s.trainer_version(1))
        assert np.allclose(r.sequence_weights(), np.exp(-0.01), atol=2e-3)
        assert r.metrics["rlcheck/corr/rollout_is_seq_min"] > 0.98
        flat = StepReport(0, {}, [], (), batch=dataclasses.replace(b, turns=None))
        assert flat.sequence_weights().max() < 1e-3  # the same tokens summed: collapsed
