"""TRL's tool loop as rlcheck reads it, without TRL: the calls `TurnRecorder` records laid onto the rows
of the flat completions, and the retokenized-history drill (rlcheck.integrations.trl.turns)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlcheck.errors import ConfigError
from rlcheck.faults import parse_inject
from rlcheck.integrations.trl.turns import TurnRecorder, check_turn_fault


class Tok:
    """Decodes ids as characters; encodes "ab" as one token (99): the canonical tokenization."""

    def decode(self, ids):
        return "".join("ab" if i == 99 else chr(ord("a") + i - 10) for i in ids)

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(99)
                i += 2
            else:
                out.append(ord(text[i]) - ord("a") + 10)
                i += 1
        return out


def trainer(outputs):
    """A stand-in GRPOTrainer whose `_generate_single_turn` answers each call with the next outputs."""
    calls = iter(outputs)

    def generate(prompt_ids, images, fields, num_generations, *args, **kwargs):
        out = next(calls)
        return out, [[-0.5] * len(o) for o in out]

    return SimpleNamespace(_generate_single_turn=generate, state=SimpleNamespace(global_step=3), _tokenizer=Tok(),
                           tools=[print])


class TestTurnRecorder:
    def test_calls_laid_on_rows(self):
        """Call 0 holds every row, call 1 the rows with a second turn, in order; each record per turn."""
        tr = trainer([[[10, 11], [12]], [[13, 14]]])
        rec = TurnRecorder(tr)
        tr._generate_single_turn([[1], [2]], None, {}, 2)
        tr._generate_single_turn([[1, 10, 11, 5, 6]], None, {}, 1)
        mask = np.array([[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=bool)
        r0, r1 = rec.records(mask, version=4)
        assert [p.tolist() for p in r0.prompt_ids] == [[1], [1, 10, 11, 5, 6]] and r0.num_turns == 2
        assert r0.logprob_counts == (2, 2) and r0.versions == (4, 4)
        assert [o.tolist() for o in r1.output_ids] == [[12]] and r1.num_turns == 1

    def test_a_new_generation_forgets_the_last(self):
        """A call with G samples per prompt starts a new generation's record."""
        tr = trainer([[[10]], [[11]], [[12]]])
        rec = TurnRecorder(tr)
        tr._generate_single_turn([[1]], None, {}, 2)
        tr._generate_single_turn([[1, 10]], None, {}, 1)
        tr._generate_single_turn([[2]], None, {}, 2)
        assert len(rec.calls) == 1

    def test_rows_that_do_not_lay_get_no_record(self):
        """A call count that does not match the rows' runs leaves the records out, never wrong."""
        tr = trainer([[[10], [12]], [[13]]])
        rec = TurnRecorder(tr)
        tr._generate_single_turn([[1], [2]], None, {}, 2)
        tr._generate_single_turn([[1, 10, 5]], None, {}, 1)
        mask = np.array([[1, 0, 1], [1, 0, 1]], dtype=bool)  # both rows claim two turns: one call short
        assert rec.records(mask) == [None, None]

    def test_retokenized_history_rewrites_the_tool_loop_prompts(self):
        """From its start step, a tool-loop call's prompt is decoded and encoded again in place; turn 0 is left alone."""
        tr = trainer([[[10, 11]], [[12]]])
        TurnRecorder(tr, parse_inject("retokenized-history@2"))
        first, later = [[10, 11]], [[10, 11, 5]]  # "a", "b": the canonical tokenization is one token
        tr._generate_single_turn(first, None, {}, 2)
        tr._generate_single_turn(later, None, {}, 1)
        assert first == [[10, 11]] and later == [[99, 5]]


class TestRefusals:
    def test_only_the_tool_loop_fault(self):
        """TRL takes retokenized-history; the other multi-turn faults need the own loop."""
        check_turn_fault(parse_inject("retokenized-history"), SimpleNamespace(tools=[print]))
        with pytest.raises(ConfigError, match="own loop"):
            check_turn_fault(parse_inject("stale-turn"))

    def test_needs_tools(self):
        with pytest.raises(ConfigError, match="tools="):
            check_turn_fault(parse_inject("retokenized-history"), SimpleNamespace(tools=[]))
