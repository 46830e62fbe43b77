"""`rlcheck.loop.task`: the addition task's prompts, its shaped reward and prompt encoding."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.loop.task import AdditionTask, encode_prompts, reward


class TestReward:
    @pytest.mark.parametrize("text", ["19", " 19", "19 apples", "The sum is 19.", "19+0=19"])
    def test_exact_answer_is_one(self, text):
        """The first integer of the response equal to the sum scores exactly 1.0."""
        assert reward(text, 19) == 1.0

    def test_only_the_first_integer_counts(self):
        """A wrong first integer is wrong even when the right sum follows it."""
        assert reward("20 or 19", 19) < 1.0

    def test_wrong_integer_decreases_with_distance(self):
        """Wrong answers of the same format score below 1, less the farther they are from the sum."""
        scores = [reward(str(guess), 19) for guess in (18, 20, 25, 40, 90)]
        assert scores[0] == scores[1]  # |guess - answer| is what counts
        assert all(0 < s < 1 for s in scores)
        assert scores[1:] == sorted(scores[1:], reverse=True) and len(set(scores[1:])) == 4

    def test_partial_credit_formula(self):
        """A wrong integer gets 0.5 * exp(-|guess - answer| / (answer + 1)) plus the digit share."""
        assert reward("25", 19) == pytest.approx(0.2 * 2 / 8 + 0.5 * np.exp(-6 / 20))

    @pytest.mark.parametrize("text", ["", "   ", "nineteen", "+=?"])
    def test_no_digits_is_zero(self, text):
        """A response without digits scores 0."""
        assert reward(text, 19) == 0.0

    def test_in_unit_interval(self):
        """Random responses (letters, digits, signs, huge integers) all score within [0, 1]."""
        rng = np.random.default_rng(0)
        alphabet = list("0123456789+-= abcxyz\n")
        texts = ["".join(rng.choice(alphabet, rng.integers(0, 30))) for _ in range(500)] + ["9" * 200]
        scores = [reward(t, int(rng.integers(0, 199))) for t in texts]
        assert all(0.0 <= s <= 1.0 for s in scores)
        assert len(set(scores)) > 50  # shaped: samples of one prompt differ


class TestAdditionTask:
    def test_deterministic_per_step(self):
        """The same seed and step draw the same prompts, also from a second task object."""
        assert AdditionTask(seed=3).prompts(5) == AdditionTask(seed=3).prompts(5)

    def test_steps_and_seeds_differ(self):
        """Different steps, and different seeds, draw different prompts."""
        task = AdditionTask()
        assert len({tuple(task.prompts(step)) for step in range(10)}) == 10
        assert AdditionTask(seed=1).prompts(0) != task.prompts(0)

    def test_prompts_and_answers(self):
        """Each prompt is "a+b=" with operands in [0, max_operand] and the answer is their sum."""
        task = AdditionTask(max_operand=9, num_prompts=50)
        prompts = task.prompts(0)
        assert len(prompts) == 50
        for text, answer in prompts:
            a, b = text.removesuffix("=").split("+")
            assert text.endswith("=") and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
            assert int(a) + int(b) == answer


@pytest.mark.slow
class TestEncodePrompts:
    def test_bos_then_text(self, tiny_model):
        """With the tiny model's tokenizer: bos first, then the text's own ids, one per character."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
        texts = ["12+7=", "3+45="]
        encoded = encode_prompts(tokenizer, texts)
        for text, ids in zip(texts, encoded, strict=True):
            assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id is not None
            assert ids[1:] == tokenizer.encode(text, add_special_tokens=False)
            assert len(ids) == 1 + len(text)  # digits, + and = are single tokens
            assert tokenizer.decode(ids[1:]) == text
