"""What the loop's trainer scores (`rlcheck.loop.trainer_view`): the engine's ids, or a trainer-input
fault's, laid against the engine's tokens by position in the step's batch; the trainer's prompt ids
and their alarm (`rlcheck.core.prompt_ids`); the first alarmed step's dump."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import DetectorsConfig, ThresholdConfig
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN, SIGNATURE, prompt_alarms
from rlcheck.core.run.dump import read_dump
from rlcheck.faults import DoubleBos, Fault, LeftPadPositions, Retokenize, StopToken

pytest.importorskip("torch")

from rlcheck.loop.trainer_view import fit, keep_first_alarm, trainer_view  # noqa: E402
from rlcheck.trainers import Sequences  # noqa: E402

BOS, EOS, PAD = 0, 1, 2


class Tokenizer:
    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [99] if text == "ab" else [10 + ord(c) - ord("a") for c in text]


def rollout(i: int, prompt: list[int], tokens: list[int], text: str):
    return SimpleNamespace(request_id=f"r{i}", vllm_request_id=str(i), prompt_index=i, sample_index=0,
                           prompt_token_ids=tuple(prompt), token_ids=tuple(tokens), text=text, weight_version=0,
                           logprobs=np.full(len(tokens), -0.5, dtype=np.float32), top_logprobs=None, experts=None)


ROLLOUTS = [rollout(0, [BOS, 5, 6], [10, 11, EOS], "ab"), rollout(1, [BOS, 7], [12, 13], "cd")]
SEQS = Sequences.build([r.prompt_token_ids for r in ROLLOUTS], [r.token_ids for r in ROLLOUTS])


def logps(view):
    """Stands in for the trainer: logprob -(position + 1) at each response token it scored."""
    return [-np.arange(1, len(r) + 1, dtype=np.float32) for r in view.seqs.responses]


class TestTrainerView:
    def test_no_fault_scores_the_engines_ids(self):
        """Without a fault the trainer scores `seqs` as they are, the batch holds the engine's ids on both sides."""
        view = trainer_view(Fault(), 0, SEQS, ROLLOUTS, Tokenizer())
        assert view.seqs is SEQS and view.touched == ()
        batch = view.step_batch(ROLLOUTS, logps(view))
        np.testing.assert_array_equal(batch.tokens_train, batch.tokens)
        assert batch.meta[PROMPT_TOKENS_TRAIN] == [[BOS, 5, 6], [BOS, 7]] and prompt_alarms(0, batch) == []

    def test_shorter_trainer_response_leaves_the_engines_last_tokens_unscored(self):
        """Retokenized "ab" is one token: its logprob meets the engine's first token, the engine's last two get 0
        and the pad id; the other sequence round-trips and is not touched."""
        view = trainer_view(Retokenize(), 0, SEQS, ROLLOUTS, Tokenizer())
        assert view.responses[0] == (99, EOS) and view.touched == (0,) and view.touched_ids(ROLLOUTS) == ["r0"]
        batch = view.step_batch(ROLLOUTS, logps(view))
        assert batch.tokens_train[:3].tolist() == [99, EOS, PAD] and batch.logp_train[:3].tolist() == [-1.0, -2.0, 0.0]
        assert batch.tokens_train[3:].tolist() == [12, 13]

    def test_trainer_prompts_are_reported_and_alarm(self):
        """double-bos: the batch carries the trainer's prompt ids, and `prompt_alarms` raises a critical
        signature alarm naming every sequence."""
        view = trainer_view(DoubleBos(), 0, SEQS, ROLLOUTS, Tokenizer())
        batch = view.step_batch(ROLLOUTS, logps(view))
        assert batch.meta[PROMPT_TOKENS_TRAIN] == [[BOS, BOS, 5, 6], [BOS, BOS, 7]]
        (alarm,) = prompt_alarms(3, batch)
        assert (alarm.kind, alarm.severity, alarm.step, alarm.details["signature"]) == ("signature", "critical", 3, SIGNATURE)
        assert alarm.details["count"] == 2 and alarm.details["request_ids"] == ["r0", "r1"]

    def test_left_padding_is_scored_but_not_reported(self):
        """The trainer's row holds the pads before the prompt; its reported prompt ids do not."""
        view = trainer_view(LeftPadPositions(), 0, SEQS, ROLLOUTS, Tokenizer())
        assert view.seqs.prompts == ((BOS, 5, 6), (PAD, BOS, 7)) and view.prompts == SEQS.prompts
        assert prompt_alarms(0, view.step_batch(ROLLOUTS, logps(view))) == []

    def test_update_trains_on_what_the_trainer_scored(self):
        """stop-token: the update's sequences are the trainer's, with its own logprobs and the loss weights
        laid on its tokens."""
        view = trainer_view(StopToken(), 0, SEQS, ROLLOUTS, Tokenizer())
        lp = logps(view)
        seqs = view.update_inputs([1.0, -1.0], lp, [np.ones(3), np.ones(2)], 4)
        assert seqs.responses == ((10, 11), (12, 13)) and [w.tolist() for w in seqs.weights] == [[1, 1], [1, 1]]
        assert [x.tolist() for x in seqs.old_logp] == [[-1, -2], [-1, -2]]

    def test_fit(self):
        assert fit(np.array([1, 2, 3]), 2, 0).tolist() == [1, 2] and fit(np.array([1.5]), 3, 0.0).tolist() == [1.5, 0, 0]


class TestFirstAlarmDump:
    def batch(self, off: float) -> StepBatch:
        lr = [np.full(8, -1.0) for _ in range(4)]
        return StepBatch.from_ragged(lr, [x + off + 1e-6 for x in lr], [f"r{i}" for i in range(4)],
                                     prompt_tokens=[[BOS, 5]] * 4, meta={PROMPT_TOKENS_TRAIN: [[BOS, 5]] * 4})

    def test_first_alarmed_step_is_dumped_once(self, tmp_path):
        """A warn alarm that does not halt leaves a dump of its step ("first alarm"), with the trainer's prompt
        ids; a later alarmed step does not add another; a step without an alarm none."""
        every = DetectorsConfig(threshold=ThresholdConfig(rearm=None))  # an alarm on every step above the limit
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",), detectors=every)) as mon:
            for step, off in enumerate((0.0, 0.3, 0.3)):
                batch = self.batch(off)
                report = mon.observe(step, batch)
                keep_first_alarm(mon, report, batch)
                assert not report.halted and bool(report.alarms) == (off > 0)
        dumps = sorted((tmp_path / "dumps").iterdir())
        assert [d.name for d in dumps] == ["step_000001"]
        rows, meta = read_dump(dumps[0])
        assert meta["reason"] == "first alarm" and [list(r[PROMPT_TOKENS_TRAIN]) for r in rows] == [[BOS, 5]] * 4

    def test_a_later_alarm_on_another_rule_is_dumped_too(self, tmp_path, monkeypatch):
        """A faint first alarm (one rule) is dumped; the same rule again is not; a later step whose alarm names
        another rule is ("new alarm": its evidence may be the stronger), up to `ALARM_DUMPS` a run. Failed before:
        one dump a run, the first alarm's."""
        from rlcheck.core import metrics as K
        from rlcheck.core.detect import ThresholdRule
        from rlcheck.loop import trainer_view as tv

        rules = (ThresholdRule(K.ABS_DIFF_MEAN, 0.1), ThresholdRule(K.ABS_DIFF_MAX, 0.5))
        only = DetectorsConfig(threshold=ThresholdConfig(rules=rules, rearm=None), robust_z=None, drift=None,
                               control_drift=None, control_trend=None, residual_trend=None, periodic=None,
                               signature=None, turns=None)

        def dumped(run_dir, offs):
            with Monitor(MonitorConfig(run_dir=run_dir, sinks=(), detectors=only)) as mon:
                for step, off in enumerate(offs):
                    batch = self.batch(off)
                    keep_first_alarm(mon, mon.observe(step, batch), batch)
            return {d.name: read_dump(d)[1]["reason"] for d in sorted((run_dir / "dumps").iterdir())}

        offs = (0.0, 0.2, 0.2, 0.6, 0.6)  # the mean's rule from step 1, the max's from step 3
        assert dumped(tmp_path / "a", offs) == {"step_000001": "first alarm", "step_000003": "new alarm"}
        monkeypatch.setattr(tv, "ALARM_DUMPS", 1)
        assert dumped(tmp_path / "b", offs) == {"step_000001": "first alarm"}
