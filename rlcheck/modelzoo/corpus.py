"""A deterministic training text for the tiny tokenizers: English-like sentences, numbers and the
arithmetic lines of the RL toy task ("12+7=19"). Generated, never downloaded; the same every call.

    python -c "from rlcheck.modelzoo.corpus import corpus; print(*corpus()[:20], sep='\\n')"
"""

from __future__ import annotations

import random

WORDS = """
the a an one two three some every no this that these those my your our their his her its
is are was were be been has have had do does did can could will would should may might must
and or but if then so because when while where after before until since than as of to in on
at by for with from into over under about between through again also only very just not more
model token number answer question value step state cache batch sequence engine trainer policy
reward sample rollout gradient weight loss score check test result error sum total count digit
cat dog bird fish tree river stone house road city garden window door table chair book paper
light water fire wind sun moon star cloud rain snow day night morning evening week year time
red green blue black white small large long short old new first last next good bad high low
run walk read write add take give make see know think say tell find keep hold turn move stop
""".split()
SYLLABLES = "ka lo mi ne ru sa to vi ze bo da fe gi hu ja ku le mo na pi qu ri su te wa xo yu".split()
NUM_PSEUDO_WORDS = 1500  # made-up words give BPE enough distinct pairs to fill a few thousand merges
PUNCT = [".", ".", ".", "?", "!", ",", ";", ":"]
NUM_LINES = 20_000
CORPUS_SEED = 1234


def _pseudo_words(rng: random.Random) -> list[str]:
    return ["".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) for _ in range(NUM_PSEUDO_WORDS)]


def _sentence(rng: random.Random, pseudo: list[str]) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    for _ in range(rng.randint(0, 3)):
        words.insert(rng.randrange(len(words)), rng.choice(pseudo))
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 4))))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(PUNCT)


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 10 ** rng.randint(1, 3)), rng.randint(0, 10 ** rng.randint(1, 3))
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    form = rng.randrange(3)
    if form == 0:
        return f"{a}{op}{b}={result}"
    if form == 1:
        return f"What is {a} {op} {b}? The answer is {result}."
    return f"Q: {a}{op}{b}\nA: {result}"


def corpus(num_lines: int = NUM_LINES, seed: int = CORPUS_SEED) -> list[str]:
    """`num_lines` lines of text, half sentences and half arithmetic, the same for the same seed."""
    rng = random.Random(seed)
    pseudo = _pseudo_words(rng)
    return [_arithmetic(rng) if rng.random() < 0.4 else _sentence(rng, pseudo) for _ in range(num_lines)]
