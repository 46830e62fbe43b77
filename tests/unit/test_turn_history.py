"""Re-tokenized or stripped history told apart without the engine's per-call prompts
(`rlcheck.forensics.diagnose.rules.turn_history`): from the dumped trained ids and the run's tokenizer, a
real (tiny) fast tokenizer where "a" "b" is the non-canonical spelling of "ab"."""

from __future__ import annotations

import pytest

from rlcheck.core import metrics as K
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.rules.turn_history import history_cause
from rlcheck.forensics.diagnose.rules.turns import multiturn

pytest.importorskip("transformers")

A, B, AB, C, X, THINK, END = range(7)
STEP = 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={"a": A, "b": B, "ab": AB, "c": C, "x": X, "<think>": THINK, "</think>": END},
                              merges=[("a", "b")]))
    tk.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    tk.decoder = decoders.Fuse()
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(path)
    return path


def row(i: int, turn0: list[int], diverged_turn: int | None = 1) -> dict:
    """A sequence: prompt [X], turn 0 = `turn0`, a tool reply [C], turn 1 [X, C]; first divergence in turn 1."""
    response = [*turn0, C, X, C]
    index = [0] * len(turn0) + [-1, 1, 1]
    return {"request_id": f"r{i}", "prompt_tokens": [X], "response_tokens": response, "turn_index": index,
            "first_divergence_turn": diverged_turn, "max_abs_diff": 3.0}


def evidence(rows: list[dict], model: str | None) -> Evidence:
    """A dump of step STEP whose turns >= 1 sit 10x above turn 0 (the shape alarm), its rows `rows`."""
    alarm = {"step": STEP, "kind": "threshold", "metric": K.TURN_LATER_RATIO, "message": "later turns off",
             "details": {"request_ids": [r["request_id"] for r in rows]}}
    record = {"step": STEP, "alarms": [alarm], "offenders": [],
              "metrics": {K.TURN_LATER_RATIO: 10.0, K.TURN_HEAD_BODY_RATIO: 1.0, K.TURN_WORST: 1.0}}
    return Evidence("dump", None, [record], {STEP: rows}, dump_meta={"context": {"model": model}})


CANONICAL_THINK = [THINK, AB, END, AB]  # "<think>ab</think>ab", spelled as the tokenizer spells it
RESPELLED = [AB, A, B]  # "abab" with its second "ab" sampled as "a" "b"


class TestHistoryCause:
    def test_stripped_history_from_canonical_histories_with_reasoning(self, tokenizer_dir):
        """Every diverged sequence's history encodes back to itself, and holds a <think> block: not re-tokenized.
        Before this rule the finding said retokenized_history (it could not tell)."""
        ev = evidence([row(i, CANONICAL_THINK) for i in range(6)], str(tokenizer_dir))
        told = history_cause(ev, [STEP])
        assert told is not None and told.cause == "stripped_history"
        assert "0 of the 6 sequences" in told.evidence[0] and "6 hold a reasoning block" in told.evidence[0]
        f = multiturn(ev)
        assert f.cause == "stripped_history" and not any("cannot be told" in e for e in f.evidence)

    def test_retokenized_history_from_respelled_histories(self, tokenizer_dir):
        """Every diverged sequence's history is spelled otherwise than the tokenizer would: re-tokenized."""
        rows = [row(i, RESPELLED) for i in range(5)] + [row(9, CANONICAL_THINK, diverged_turn=None)]
        told = history_cause(evidence(rows, str(tokenizer_dir)), [STEP])
        assert told is not None and told.cause == "retokenized_history"
        assert "5 of the 5 sequences" in told.evidence[0]
        assert multiturn(evidence(rows, str(tokenizer_dir))).cause == "retokenized_history"

    @pytest.mark.parametrize("case", ["mixed", "no_reasoning", "few", "no_tokenizer", "redacted", "turn_0"])
    def test_tells_nothing_otherwise(self, tokenizer_dir, case):
        """A mixed picture, canonical histories with nothing to strip, too few sequences, no tokenizer, no ids,
        divergence in turn 0: no verdict, and the finding keeps saying it cannot tell."""
        rows = {"mixed": [row(i, RESPELLED if i % 2 else CANONICAL_THINK) for i in range(6)],
                "no_reasoning": [row(i, [AB, C]) for i in range(6)],
                "few": [row(i, CANONICAL_THINK) for i in range(2)],
                "no_tokenizer": [row(i, CANONICAL_THINK) for i in range(6)],
                "redacted": [{**row(i, CANONICAL_THINK), "response_tokens": None} for i in range(6)],
                "turn_0": [row(i, CANONICAL_THINK, diverged_turn=0) for i in range(6)]}[case]
        model = str(tokenizer_dir / "absent") if case == "no_tokenizer" else str(tokenizer_dir)
        ev = evidence(rows, model)
        assert history_cause(ev, [STEP]) is None
        f = multiturn(ev)
        assert f.cause == "retokenized_history" and any("cannot be told" in e for e in f.evidence)
