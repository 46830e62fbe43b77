"""`rlcheck diagnose`'s rules of issue 28 on run directories the real Monitor wrote from loop-like
synthetic steps (8 prompts x 4 samples), at both precision pairs the loop runs (fp32/fp32: agreement to
1e-6; a bf16 engine: the field's per-token bf16 noise, each fault 20x its fp32 size), each with one cause's evidence in its
sequences: the trainer's prompt with BOS twice, re-tokenized responses, the stop token dropped, left
padding the trainer attends to, a position-dependent mismatch, a stale shared prefix after the first
steps, a temperature on a peaked model, a few far-off rows; and healthy runs with the same prompt
shapes. A step that alarms keeps its dump as the loop does (`rlcheck.loop.trainer_view.keep_first_alarm`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.detect import DetectorsConfig, RobustZConfig
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN, prompt_alarms
from rlcheck.errors import MismatchHalt
from rlcheck.forensics.diagnose import CAUSES, diagnose

BOS, EOS, PAD = 0, 1, 2
ONSET = 8
PAIRS = {"fp32": Precision("float32", "float32"), "bf16": Precision("bfloat16", "float32")}
FAULT_SIZE = {"fp32": 1.0, "bf16": 20.0}
"""A fault's size over its fp32 one: what stands as far above a bf16 engine's noise."""
PAIR = {"now": "fp32"}
"""The precision pair of the run being recorded (the `runs` fixture sets it)."""


def size() -> float:
    return FAULT_SIZE[PAIR["now"]]
LONG = 300


def prompts(step: int, long: str | None = None) -> list[list[int]]:
    """8 prompts of 4 to 6 ids after BOS (at least one of each length); `long`: prompts 0, 2, 4, 6 open with
    LONG more ids, the same for all ("shared") or their own ("own")."""
    rng = np.random.default_rng([7, step])
    out = [[BOS, *rng.integers(10, 60, 4 + i % 3).tolist()] for i in range(8)]
    if long is not None:
        for i in range(0, 8, 2):
            head = np.random.default_rng(0 if long == "shared" else 100 + i).integers(60, 2000, LONG).tolist()
            out[i] = [BOS, *head, *out[i][1:]]
    return out


@dataclasses.dataclass
class Step:
    """One step's sequences, before they become a StepBatch: per sequence its prompt, the engine's and
    the trainer's response ids and logprobs; `off(i, t)` adds to the trainer's logprob of token t of sequence i."""

    prompts: list[list[int]]
    tokens: list[np.ndarray]
    lr: list[np.ndarray]
    lt: list[np.ndarray]
    trainer_prompts: list[list[int]]
    trainer_tokens: list[np.ndarray]

    def batch(self) -> StepBatch:
        n = len(self.tokens)
        lt = [np.minimum(x, 0.0) for x in self.lt]  # logprobs: the noise does not push one past 0
        return StepBatch.from_ragged(self.lr, lt, [f"r{i}" for i in range(n)], tokens=self.tokens,
                                     tokens_train=self.trainer_tokens, prompt_tokens=self.prompts,
                                     meta={PROMPT_TOKENS_TRAIN: self.trainer_prompts})


def step_of(step: int, long: str | None = None, length: int = 12) -> Step:
    """4 samples of each prompt; responses of `length` ids, half ending with EOS; the engine's logprobs of
    a peaked model (most near 0), the trainer's within 1e-6 of them."""
    rng = np.random.default_rng([3, step])
    ps = [p for p in prompts(step, long) for _ in range(4)]
    tokens = [rng.integers(10, 2000, length) for _ in ps]
    for t in tokens[::2]:
        t[-1] = EOS
    lr = [np.where(rng.random(length) < 0.6, -rng.exponential(0.02, length), -rng.exponential(1.0, length)) for _ in ps]
    lt = [x + noise(rng, x) for x in lr]
    return Step(ps, tokens, lr, lt, [list(p) for p in ps], [t.copy() for t in tokens])


def noise(rng: np.random.Generator, lr: np.ndarray) -> np.ndarray:
    """The trainer's disagreement at the pair's floor: 1e-6 (fp32), or bf16's per-token law (|d| ~ (1 - p)^0.91
    x log-normal, sigma 1.45: mean ~1e-2 on the uncertain tokens; `rlcheck.synthetic.field`)."""
    if PAIR["now"] == "fp32":
        return rng.normal(0, 1e-6, lr.size)
    sign = np.where(rng.random(lr.size) < 0.5, -1.0, 1.0)
    return sign * 0.004 * np.exp(1.45 * rng.standard_normal(lr.size)) * (-np.expm1(lr)) ** 0.91


def record(run_dir: Path, make_step, steps: int = ONSET + 4) -> Path:
    """Feed the Monitor `make_step(step).batch()` (with the prompt-id alarm, as the loop does) until the steps
    end or it halts; the first alarmed step that does not halt is dumped. The precision pair named, as the
    loop's context names it (`rlcheck.core.floors`)."""
    detectors = DetectorsConfig(robust_z=RobustZConfig(warmup=ONSET))
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), detectors=detectors, precision=PAIRS[PAIR["now"]])) as mon:
        for step in range(steps):
            batch = make_step(step).batch()
            try:
                report = mon.observe(step, batch, alarms=prompt_alarms(step, batch))
            except MismatchHalt:
                break
            if report.alarms and not (run_dir / "dumps").exists():
                mon.dump(step, batch, report, reason="first alarm")
    return run_dir


def double_bos(step: int) -> Step:
    s = step_of(step)
    if step >= ONSET:
        s.trainer_prompts = [[BOS, *p] for p in s.prompts]
        s.lt = [x + np.random.default_rng(i).normal(0, 0.01, x.size) for i, x in enumerate(s.lt)]
    return s


def retokenized(step: int) -> Step:
    """From ONSET, a quarter of the sequences: two ids merged into one from a mid-sequence token, the rest
    moved up and a pad at the end; the trainer's logprobs of the moved tokens are others."""
    s = step_of(step)
    if step >= ONSET:
        for i in range(0, len(s.tokens), 4):
            t, at = s.trainer_tokens[i], 3 + i % 5
            s.trainer_tokens[i] = np.concatenate([t[:at], [1999], t[at + 2:], [PAD]])
            s.lt[i][at:] = s.lr[i][at:] - np.abs(np.random.default_rng(i).normal(2.0, 1.0, t.size - at))
    return s


def stop_dropped(step: int) -> Step:
    s = step_of(step)
    if step >= ONSET:
        for t, tt, lt in zip(s.tokens, s.trainer_tokens, s.lt, strict=True):
            if t[-1] == EOS:
                tt[-1], lt[-1] = PAD, 0.0
    return s


@dataclasses.dataclass
class IdsUnknown(Step):
    """A step whose batch holds no trainer ids (verl's: its rows carry the engine's ids only)."""

    def batch(self) -> StepBatch:
        return dataclasses.replace(super().batch(), tokens_train=None)


def stop_unscored(step: int) -> Step:
    """verl's stop-token shape (measured on its real trainer, a bf16 engine: the EOS off by 0.45 nats on
    average, median 0.08, every other token at the floor): from ONSET the trainer's logprob of each EOS
    off by a log-normal amount with that median and mean, no trainer ids to compare."""
    s = IdsUnknown(**dataclasses.asdict(step_of(step)))
    if step >= ONSET:
        rng = np.random.default_rng([11, step])
        for t, lt in zip(s.tokens, s.lt, strict=True):
            if t[-1] == EOS:
                lt[-1] -= 0.08 * np.exp(1.86 * rng.standard_normal())
    return s


def stop_zeroed(step: int) -> Step:
    """verl's legacy trainer scoring the stopped responses without their EOS (its real run, a bf16 engine): the
    trainer's logprob of each EOS is exactly 0.0 and |d| is the engine's own logprob there, which a confident
    model makes tiny on most rows (one run: 0.002 to 4.8 nats, median 0.049, mean 0.73); no trainer ids."""
    s = IdsUnknown(**dataclasses.asdict(step_of(step)))
    rng = np.random.default_rng([13, step])
    for t, lr, lt in zip(s.tokens, s.lr, s.lt, strict=True):
        if t[-1] == EOS:  # a confident model's EOS: 9 rows in 16 near-certain, the rest not
            lr[-1] = -0.005 * np.exp(rng.standard_normal()) if rng.random() < 0.6 else -np.exp(rng.normal(0, 1))
            lt[-1] = lr[-1] + noise(rng, lr[-1:])[0]
            if step >= ONSET:
                lt[-1] = 0.0
    return s


def left_padded(step: int) -> Step:
    """From ONSET, each row off by 0.01 x the pad tokens its prompt would get (rows of the longest prompt exact)."""
    s = step_of(step)
    if step >= ONSET:
        width = max(len(p) for p in s.prompts)
        for i, p in enumerate(s.prompts):
            s.lt[i] = s.lt[i] - 0.01 * size() * (width - len(p)) * np.abs(np.random.default_rng(i).normal(1, 0.3, s.lt[i].size))
    return s


def left_padded_one(step: int) -> Step:
    """From ONSET, one prompt shorter than all the others by one id: its 4 rows off by 0.01 (x the pair's size), the
    28 others exact to the pair's noise (the trained hybrid's step: one prompt of eight shorter)."""
    s = step_of(step)
    width = max(len(p) for p in s.prompts)
    s.prompts = [p + [7] * (width - len(p)) if i >= 4 else p[: width - 1] for i, p in enumerate(s.prompts)]
    s.trainer_prompts = [list(p) for p in s.prompts]
    if step >= ONSET:
        for i in range(4):
            s.lt[i] = s.lt[i] - 0.01 * size() * np.abs(np.random.default_rng(i).normal(1, 0.3, s.lt[i].size))
    return s


def rope(step: int) -> Step:
    """From the first step: |d| grows with the token's position (prompts 0, 2, ... carry long contexts of their own)."""
    s = step_of(step, long="own")
    for i, p in enumerate(s.prompts):
        pos = len(p) + np.arange(s.lt[i].size)
        s.lt[i] = s.lt[i] - 2e-4 * size() * pos * np.abs(np.random.default_rng(i).normal(1, 0.3, pos.size))
    return s


def stale_prefix(step: int) -> Step:
    """From ONSET, the rows whose prompt opens with the shared LONG-id prefix are off, growing with the step."""
    s = step_of(step, long="shared")
    if step >= ONSET:
        for i, p in enumerate(s.prompts):
            if len(p) > LONG:
                s.lt[i] = s.lt[i] + (step - ONSET + 1) * np.random.default_rng([i, step]).normal(0, 0.02 * size(), s.lt[i].size)
    return s


def hotter(step: int) -> Step:
    """The engine reports log_softmax(z) of the sampled token, the trainer log_softmax(z / 0.7), over a
    peaked 64-token distribution per position (one logit 6 above the rest, N(0, 2))."""
    s = step_of(step)
    rng = np.random.default_rng([11, step])
    for i, x in enumerate(s.lr):
        z = rng.normal(0, 2.0, (x.size, 64))
        z[:, 0] += 6.0
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        tok = np.array([rng.choice(64, p=row) for row in p])
        s.lr[i] = log_softmax(z)[np.arange(x.size), tok]
        s.lt[i] = log_softmax(z / 0.7)[np.arange(x.size), tok] + noise(rng, s.lr[i])
    return s


def nucleus(step: int) -> Step:
    """A random model (every sampled token ~7 nats) whose engine samples from its top-p nucleus (mass 0.9) and
    returns the renormalised logprob: logp_rollout = logp_train - log 0.9 on every token, from the first step."""
    s = step_of(step)
    rng = np.random.default_rng([13, step])
    for i, x in enumerate(s.lr):
        lt = -rng.uniform(6.0, 8.0, x.size)
        s.lr[i] = lt - np.log(0.9)
        s.lt[i] = lt + noise(rng, s.lr[i])
    return s


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def sparse(step: int, off: float = 2.0) -> Step:
    """From ONSET, two sequences off by `off` from their second token, the rest exact."""
    s = step_of(step)
    if step >= ONSET:
        for i in (3, 17):
            s.lt[i][1:] = s.lr[i][1:] - off
    return s


def bos_and_shift(step: int) -> Step:
    """double_bos whose trainer also reads the response ids one token late (its prompt one longer)."""
    s = double_bos(step)
    if step >= ONSET:
        s.trainer_tokens = [np.concatenate([t[1:], t[-1:]]) for t in s.tokens]
    return s


CASES = {"double_bos": double_bos, "bos_and_shift": bos_and_shift, "retokenized": retokenized, "stop_dropped": stop_dropped,
         "stop_unscored": stop_unscored, "stop_zeroed": stop_zeroed,
         "left_padded": left_padded, "left_padded_one": left_padded_one,
         "rope": rope, "stale_prefix": stale_prefix, "hotter": hotter, "nucleus": nucleus, "sparse": sparse,
         "sparse_small": lambda s: sparse(s, 0.01),
         "clean": step_of, "clean_shared": lambda s: step_of(s, long="shared"), "clean_own": lambda s: step_of(s, long="own")}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    done: dict[tuple[str, str], Path] = {}

    def get(name: str, pair: str) -> Path:
        if (name, pair) not in done:
            PAIR["now"] = pair
            done[name, pair] = record(tmp_path_factory.mktemp(f"{name}-{pair}"), CASES[name])
        return done[name, pair]

    return get


@pytest.fixture(params=sorted(PAIRS))
def pair(request) -> str:
    return request.param


@pytest.fixture
def runs(recorded, pair):
    """`runs(name)`: the case recorded at the test's precision pair (each test runs at both)."""
    return lambda name: recorded(name, pair)


class TestEvidenceRules:
    @pytest.mark.parametrize("name", ["clean", "clean_shared", "clean_own"])
    def test_healthy_runs_stay_healthy(self, runs, name):
        """Varied prompt lengths, a long shared prefix or long contexts of their own, no fault: healthy, alone."""
        result = diagnose(runs(name))
        assert [f.cause for f in result.findings] == ["healthy"]

    def test_bos_twice_is_a_prompt_mismatch(self, runs):
        """The trainer's prompt ids carry BOS twice: prompt_mismatch, saying so, naming every sequence, from the
        run and from the halt's dump alone."""
        for path in (runs("double_bos"), runs("double_bos") / "dumps" / f"step_{ONSET:06d}"):
            v = diagnose(path).verdict
            assert v.cause == "prompt_mismatch" and v.affected_steps[0] == ONSET, v.evidence
            assert "BOS" in v.evidence[0] and "2 times" in v.evidence[0] and len(v.affected_request_ids) == 32

    def test_prompt_mismatch_says_what_the_response_ids_do(self, runs):
        """The prompt-id finding checks the response ids before it says they agree: with the trainer's
        response ids read one token late as well, it says they differ (it said "agree" unchecked)."""
        (same,) = [f for f in diagnose(runs("double_bos")).findings if f.cause == "prompt_mismatch"]
        assert "the response ids agree" in same.evidence[1]
        (shifted,) = [f for f in diagnose(runs("bos_and_shift")).findings if f.cause == "prompt_mismatch"]
        assert "agree" not in shifted.evidence[1] and "response ids differ on 32 of them too" in shifted.evidence[1]

    def test_retokenized_responses(self, runs):
        """A quarter of the sequences part from the engine's ids mid-sequence (a merge): retokenization,
        naming exactly those sequences; token_misalignment only as an alternative."""
        result = diagnose(runs("retokenized"))
        v = result.verdict
        assert v.cause == "retokenization" and v.affected_steps == [ONSET], v.evidence
        assert set(v.affected_request_ids) == {f"r{i}" for i in range(0, 32, 4)}
        assert "mid-sequence" in v.evidence[1] and "token_misalignment" in [f.cause for f in result.findings[1:]]

    def test_stop_token_dropped(self, runs):
        """Only the last token of the sequences ending with EOS differs: stop_token, naming EOS and those sequences."""
        v = diagnose(runs("stop_dropped")).verdict
        assert v.cause == "stop_token" and f"token {EOS}" in v.evidence[0], v.evidence
        assert set(v.affected_request_ids) == {f"r{i}" for i in range(0, 32, 2)}

    def test_stop_token_without_the_trainers_ids(self, runs):
        """The EOS alone off, heavy-tailed (median 0.08, mean 0.45 nats), no trainer ids in the dump (verl):
        stop_token at either precision (at a bf16 engine it read as 'no known shape': the contrast was
        floored at 10x the precision's noise, 0.1, not at its noise)."""
        v = diagnose(runs("stop_unscored")).verdict
        assert v.cause == "stop_token" and f"token {EOS}" in v.evidence[0], v.evidence

    def test_stop_token_zeroed_on_one_side(self, runs, pair):
        """The trainer's logprob of each EOS exactly 0.0 (a stop token it never scored), the engine confident of
        most of them: the median EOS |d| sits under the contrast at a bf16 floor (verl's legacy run once read
        'unexplained' so), the exact zeros where the engine was unsure name it: stop_token, saying which side."""
        v = diagnose(runs("stop_zeroed")).verdict
        assert v.cause == "stop_token" and v.affected_steps == [ONSET], v.evidence
        assert f"token {EOS}" in v.evidence[0]
        assert pair == "fp32" or any("the trainer's logprob of token" in e for e in v.evidence), v.evidence

    def test_left_padding(self, runs):
        """Rows off with their prompt's padding, the longest prompts' rows exact: position_ids, naming the padded rows."""
        v = diagnose(runs("left_padded")).verdict
        assert v.cause == "position_ids" and v.affected_steps == [ONSET], v.evidence
        lengths = [len(p) for p in prompts(ONSET) for _ in range(4)]
        assert set(v.affected_request_ids) == {f"r{i}" for i, n in enumerate(lengths) if n < max(lengths)}

    def test_one_short_prompt(self, runs):
        """Only one prompt's rows padded (by one id), the other rows within the pair's noise of exact: position_ids,
        naming those 4 rows (the cut between the groups never falls inside the precision's noise)."""
        v = diagnose(runs("left_padded_one")).verdict
        assert v.cause == "position_ids" and set(v.affected_request_ids) == {"r0", "r1", "r2", "r3"}, v.evidence

    def test_position_dependent(self, runs):
        """|d| growing with the position from the first step: position_dependent, with |d| by position."""
        v = diagnose(runs("rope")).verdict
        assert v.cause == "position_dependent" and "by position" in v.evidence[0], v.evidence

    def test_stale_prefix(self, runs):
        """Clean steps, then the rows sharing the long prefix off: stale_prefix_cache, naming only those rows."""
        v = diagnose(runs("stale_prefix")).verdict
        assert v.cause == "stale_prefix_cache" and v.affected_steps == [ONSET], v.evidence
        assert set(v.affected_request_ids) == {f"r{i}" for i in range(32) if (i // 4) % 2 == 0}
        assert f"{LONG + 1}-token prefix" in v.evidence[0]

    def test_temperature_on_a_peaked_model(self, runs):
        """The trainer gives the likely tokens more probability on every one of them: logit_processing."""
        v = diagnose(runs("hotter")).verdict
        assert v.cause == "logit_processing", v.evidence

    def test_top_p_on_a_random_model(self, runs):
        """No likely token to read, but the engine's renormalised nucleus puts d = log 0.9 on every token of every
        sequence: logit_processing."""
        v = diagnose(runs("nucleus")).verdict
        assert v.cause == "logit_processing" and "renormalised" in v.evidence[1], v.evidence

    @pytest.mark.parametrize("name", ["sparse", "sparse_small"])
    def test_a_few_far_off_rows_are_stale_state(self, recorded, name, pair):
        """Two sequences off from their second token (2 nats; 0.01, a confident model's corrupted tokens), the rest
        exact: stale_state, naming those two (0.01 nats only at fp32: under a bf16 engine's noise it is noise)."""
        if name == "sparse_small" and pair == "bf16":
            pytest.skip("0.01 nats is inside a bf16 engine's noise")
        v = diagnose(recorded(name, pair)).verdict
        assert v.cause == "stale_state" and set(v.affected_request_ids) == {"r3", "r17"}, v.evidence

    def test_new_causes_have_titles(self):
        assert {"stale_prefix_cache", "retokenization", "prompt_mismatch", "position_ids", "stop_token",
                "position_dependent"} <= set(CAUSES)


class TestProbeOnlyWeightsAlarm:
    def run(self, tmp_path, differing: list[str]) -> object:
        """One clean step, then a critical sync-check alarm: `differing` fingerprints (none: only the probe failed)."""
        from rlcheck.core.types import Alarm

        alarm = Alarm("weights", "sync/probe_mean_abs", 1, "critical", "the sync check failed",
                      {"differing": differing, "layers": [], "probe": {"ok": False}})
        PAIR["now"] = "fp32"
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            mon.observe(0, step_of(0).batch())
            with pytest.raises(MismatchHalt):
                mon.observe(1, step_of(1).batch(), alarms=[alarm])
        return diagnose(tmp_path).verdict

    def test_same_weights_computing_otherwise_ranks_below_the_shapes(self, tmp_path):
        """Only the probe failed, every fingerprint agreed: weights_out_of_sync at 0.85 (a shape rule's 0.9 outranks
        it), saying the weights are the trainer's; with a differing fingerprint 0.99 as before."""
        v = self.run(tmp_path / "probe", [])
        assert (v.cause, v.confidence) == ("weights_out_of_sync", 0.85) and "fingerprints agree" in v.evidence[-1]
        v = self.run(tmp_path / "fingerprint", ["1:linear"])
        assert (v.cause, v.confidence) == ("weights_out_of_sync", 0.99)


class TestTokenPattern:
    ENGINE = [11, 12, 13, 14, 15, 16, 17, 18]

    @pytest.mark.parametrize("trainer, pattern, direction", [
        ([12, 13, 14, 15, 16, 17, 18, 18], "shift", "late"),  # read one token late
        ([11, 11, 12, 13, 14, 15, 16, 17], "shift", "early"),  # one early, the first token its own
        ([99, 11, 12, 13, 14, 15, 16, 17], "shift", "early"),  # one early, the prompt's last token first
        ([11, 12, 13, 14, 99, 16, 17, 18], "from", None),  # parts mid-sequence: another tokenization
        ([11, 12, 13, 14, 15, 16, 17, 99], "last", None),
        (ENGINE, None, None),
    ])
    def test_both_directions_of_a_shift(self, trainer, pattern, direction):
        """A one-token shift either way is "shift" (and which way it goes); a later parting is "from"."""
        from rlcheck.forensics.diagnose.rows import shift_direction, token_pattern

        row = {"response_tokens": self.ENGINE, "tokens_train": trainer}
        assert token_pattern(row) == pattern
        engine, theirs = np.asarray(self.ENGINE), np.asarray(trainer)
        diff = np.flatnonzero(engine != theirs)
        assert (shift_direction(engine, theirs, int(diff[0])) if diff.size else None) == direction


class TestSpearman:
    def test_one_tie_rule(self):
        """One rank correlation for every rule, ties ranked by their average: a flat series with one
        late step up is not "rising" (ties broken by their order read it as a perfect 1.0)."""
        from rlcheck.forensics.diagnose import queries, rows
        from rlcheck.forensics.diagnose.rules import position

        steps, flat = np.arange(6.0), np.array([1.0, 1.0, 1.0, 1.0, 1.0, 2.0])
        assert queries.spearman(steps, flat) == pytest.approx(np.corrcoef(steps, [3, 3, 3, 3, 3, 6])[0, 1])
        assert queries.spearman(steps, flat) < 0.8 and not queries.rising(steps, flat)
        assert queries.spearman(steps, steps ** 2) == pytest.approx(1.0) and queries.spearman(steps, np.ones(6)) == 0.0
        assert position.spearman is queries.spearman and not hasattr(rows, "spearman")
