"""`rlcheck.faults`: `parse_inject` maps NAME[=VALUE][@START] text onto faults, and each fault of the zoo
acts through its hooks as documented (syncs skipped, trainer config changed, step batches corrupted)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.errors import ConfigError
from rlcheck.faults import (
    FAULTS,
    Bf16Noise,
    CorruptSequences,
    Fault,
    OffByOne,
    SkipSync,
    StaleWeights,
    TemperatureMismatch,
    TopP,
    parse_inject,
)
from rlcheck.faults.zoo import BF16_EPS
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

SMALL = SyntheticConfig(num_sequences=64, mean_length=64)


@dataclass(frozen=True)
class Sampling:
    """Stands in for the trainer's config: the faults only `dataclasses.replace` its temperature."""

    temperature: float = 1.0
    lr: float = 1e-4


SPECS = [
    "skip-sync-every=3", "skip-sync-every=5@10",
    "stale-weights", "stale-weights@40",
    "temperature-mismatch=1.1", "temperature-mismatch=0.8",
    "top-p=0.9", "top-p=0.5",
    "off-by-one", "off-by-one@7", "off-by-one-early", "off-by-one-early@7",
    "bf16-noise=2", "bf16-noise=0.5@3",
    "corrupt-seqs=1", "corrupt-seqs=0.02@40",
]


class TestParseInject:
    @pytest.mark.parametrize("spec", [None, ""])
    def test_none_is_no_fault(self, spec):
        """No spec gives the do-nothing fault, which never skips a sync."""
        fault = parse_inject(spec)
        assert type(fault) is Fault and fault.describe() == "none"
        assert not any(fault.skip_sync(step) for step in range(100))

    def test_skip_sync_every(self):
        """skip-sync-every=4 skips the syncs after the updates of steps 3, 7 and 11 (of 0..12) only."""
        fault = parse_inject("skip-sync-every=4")
        assert fault == SkipSync(4)
        assert [step for step in range(13) if fault.skip_sync(step)] == [3, 7, 11]

    def test_describe_round_trips(self):
        """`describe()` is the spec that parses back to the same fault."""
        fault = SkipSync(7)
        assert parse_inject(fault.describe()) == fault

    @pytest.mark.parametrize("spec", SPECS)
    def test_every_fault_round_trips(self, spec):
        """Each fault of the zoo parses to its class, with START as its first step, and `describe()` gives the spec back."""
        name, _, start = spec.partition("@")
        fault = parse_inject(spec, seed=7)
        assert type(fault) is FAULTS[name.partition("=")[0]][0]
        assert fault.start == int(start or 0) and fault.seed == 7
        assert fault.describe() == spec and parse_inject(fault.describe(), seed=7) == fault

    def test_start_zero_describes_without_at(self):
        """`@0` is the default start, so it parses to the fault written without it."""
        assert parse_inject("off-by-one@0") == OffByOne() and OffByOne().describe() == "off-by-one"

    @pytest.mark.parametrize("spec, match", [
        ("skip-sync=4", "unknown fault"),
        ("drop-weights=1", "unknown fault"),
        ("skip-sync-every", "integer"),
        ("skip-sync-every=", "integer"),
        ("skip-sync-every=four", "integer"),
        ("skip-sync-every=2.5", "integer"),
        ("skip-sync-every=1", "K >= 2"),
        ("skip-sync-every=0", "K >= 2"),
        ("skip-sync-every=-3", "K >= 2"),
        ("stale-weights=3", "takes no value"),
        ("off-by-one=1", "takes no value"),
        ("off-by-one=", "takes no value"),
        ("stale-weights@", "START"),
        ("stale-weights@x", "START"),
        ("corrupt-seqs=0.1@1.5", "START"),
        ("skip-sync-every=4@", "START"),
        ("temperature-mismatch=1.1@5", "first step"),
        ("temperature-mismatch=1", "other than 1"),
        ("temperature-mismatch=1.0", "other than 1"),
        ("temperature-mismatch=0", "factor > 0"),
        ("temperature-mismatch=-1.1", "factor > 0"),
        ("temperature-mismatch", "a number"),
        ("top-p=1", r"\(0, 1\)"),
        ("top-p=0", r"\(0, 1\)"),
        ("top-p=nan", r"\(0, 1\)"),
        ("top-p", "a number"),
        ("top-p=0.9@2", "first step"),
        ("corrupt-seqs=0", r"\(0, 1\]"),
        ("corrupt-seqs=1.5", r"\(0, 1\]"),
        ("corrupt-seqs=-0.1", r"\(0, 1\]"),
        ("corrupt-seqs=nan", r"\(0, 1\]"),
        ("bf16-noise=0", "scale > 0"),
        ("bf16-noise=-1", "scale > 0"),
        ("bf16-noise=one", "a number"),
        ("drop-sync", "name pattern"),
        ("drop-sync=", "name pattern"),
        ("stale-buffer=1", "takes no value"),
        ("stale-buffer@3", "first sync"),
    ])
    def test_rejects_bad_specs(self, spec, match):
        """Unknown names, missing or malformed values, a value for a fault without one, a START that is not
        an integer and out-of-range values are ConfigErrors saying which."""
        with pytest.raises(ConfigError, match=match):
            parse_inject(spec)


class TestSyncSpoilers:
    def test_drop_sync_leaves_out_its_pattern_from_start(self):
        fault = parse_inject("drop-sync=mlp.down_proj@3")
        assert [fault.sync_spoil(s) for s in (2, 3, 9)] == [None, "mlp.down_proj", "mlp.down_proj"]
        assert not fault.skip_sync(3) and fault.describe() == "drop-sync=mlp.down_proj@3"
        assert fault.cause == "weights_out_of_sync" and not fault.spoils_syncs

    def test_permute_sync_rolls_the_rows_of_its_pattern_from_start(self):
        """permute-sync=q_proj@2: from the sync after update 2, every tensor named *q_proj* is sent with
        its rows rolled by one (the same values in another order), everything else as it is."""
        import torch

        from rlcheck.faults.base import spoil_sync

        fault = parse_inject("permute-sync=q_proj@2")
        assert [fault.sync_spoil(s) for s in (1, 2)] == [None, "permute:q_proj"]
        assert fault.describe() == "permute-sync=q_proj@2" and fault.cause == "weights_out_of_sync"
        q, k = torch.arange(6.0).reshape(3, 2), torch.ones(3, 2)
        sent = dict(spoil_sync([("l.0.q_proj.weight", q), ("l.0.k_proj.weight", k)], fault.sync_spoil(2)))
        assert sent["l.0.q_proj.weight"].tolist() == [[4.0, 5.0], [0.0, 1.0], [2.0, 3.0]]
        assert sent["l.0.k_proj.weight"] is k
        assert dict(spoil_sync([("a.mlp.w", q), ("b.attn.w", k)], "mlp")) == {"b.attn.w": k}  # drop-sync

    def test_stale_buffer_acts_inside_the_engine(self):
        fault = parse_inject("stale-buffer")
        assert fault.engine_fault() == ("stale-buffer", {}) and fault.spoils_syncs
        assert fault.sync_spoil(5) is None and not fault.skip_sync(5)


    @pytest.mark.parametrize(("spec", "hookable"), [("stale-state", True), ("index-wrap=4", True),
                                                   ("perturb-layer=1", True), ("stale-buffer", True),
                                                   ("drop-sync=mlp", False), ("bf16-noise=1", False)])
    def test_engine_faults_ask_for_a_hookable_engine(self, spec, hookable):
        """An engine fault hooks vLLM's model runner: its engine is built eager on the V1 runner."""
        from rlcheck.engines.vllm import VLLMConfig

        assert parse_inject(spec).rollout_config(VLLMConfig(model="m")).hookable is hookable


class TestSkipSync:
    def test_rejects_k_below_two(self):
        """Constructed directly, K = 1 (never sync) is a ConfigError too."""
        with pytest.raises(ConfigError):
            SkipSync(1)

    @pytest.mark.parametrize("every", [2, 3, 5])
    def test_one_skip_per_period(self, every):
        """Over any K consecutive steps exactly one sync is skipped, the one after step K-1 mod K."""
        fault = SkipSync(every)
        skipped = [s for s in range(10 * every) if fault.skip_sync(s)]
        assert skipped == list(range(every - 1, 10 * every, every))

    def test_no_skip_before_start(self):
        """With a start step, the first sync left out is the first one at phase K-1 from that step on."""
        fault = SkipSync(4, start=10)
        assert [s for s in range(20) if fault.skip_sync(s)] == [11, 15, 19]


class TestFault:
    def test_changes_nothing(self):
        """The base fault returns the batch and the config as they came, touches nobody and never skips a sync."""
        fault, batch, cfg = Fault(), synthetic_batch(SMALL, 3), Sampling()
        out, hit = fault.apply(3, batch)
        assert out is batch and hit == []
        assert fault.trainer_config(cfg) is cfg
        assert not any(fault.skip_sync(step) for step in range(50))

    def test_active_from_start(self):
        """A fault acts from its `start` step on, not before."""
        assert [s for s in range(8) if Fault(start=5).active(s)] == [5, 6, 7]

    @pytest.mark.parametrize("fault", [OffByOne(start=32), Bf16Noise(scale=4, start=32),
                                       CorruptSequences(rate=0.5, start=32)], ids=lambda f: f.name)
    def test_data_faults_wait_for_start(self, fault):
        """A data-level fault passes the batch through untouched before its start step and corrupts it from there."""
        before, at_start = synthetic_batch(SMALL, 31), synthetic_batch(SMALL, 32)
        out, hit = fault.apply(31, before)
        assert out is before and hit == []
        out, hit = fault.apply(32, at_start)
        same = (np.array_equal(out.logp_rollout, at_start.logp_rollout)
                and np.array_equal(out.logp_train, at_start.logp_train))
        assert hit and not same


class TestStaleWeights:
    def test_syncs_stop_before_start(self):
        """The sync after the update of step START-1 is the first left out: the rollouts of START on are stale."""
        fault = StaleWeights(start=40)
        assert not any(fault.skip_sync(s) for s in range(39))
        assert all(fault.skip_sync(s) for s in range(39, 100))

    def test_start_zero_never_syncs(self):
        """From the first step on, no sync happens at all."""
        assert all(StaleWeights().skip_sync(s) for s in range(20))

    def test_leaves_the_data_alone(self):
        """The fault acts through the syncs only: `apply` changes no logprob and touches nobody."""
        batch = synthetic_batch(SMALL, 50)
        out, hit = StaleWeights(start=40).apply(50, batch)
        assert out is batch and hit == []


class TestTemperatureMismatch:
    def test_trainer_config_multiplies_temperature(self):
        """The trainer's temperature becomes factor x the sampling one; the other fields stay."""
        cfg = TemperatureMismatch(factor=1.25).trainer_config(Sampling(temperature=0.8))
        assert cfg.temperature == pytest.approx(1.0) and cfg.lr == Sampling().lr

    def test_apply_touches_every_request(self):
        """The data is left as the trainer made it, and every request of the step counts as touched."""
        batch = synthetic_batch(SMALL, 0)
        out, hit = TemperatureMismatch(factor=0.9).apply(0, batch)
        assert out is batch and hit == list(batch.request_ids)


class TestTopP:
    def test_rollout_config_samples_the_nucleus(self):
        """The engine's config gets top_p and allow_logit_processing; its other sampling fields stay;
        the trainer's config is left alone."""
        from rlcheck.engines.vllm import VLLMConfig

        cfg = TopP(p=0.8).rollout_config(VLLMConfig(model="m", sampling={"stop": ["\\n"]}))
        assert cfg.sampling == {"stop": ["\\n"], "top_p": 0.8} and cfg.allow_logit_processing
        assert TopP().trainer_config(Sampling()) == Sampling()
        assert Fault().rollout_config(cfg) is cfg

    def test_cause_and_touched(self):
        """Diagnose should name logit processing; every request of the step counts as touched."""
        batch = synthetic_batch(SMALL, 0)
        out, hit = parse_inject("top-p=0.9").apply(0, batch)
        assert TopP.cause == "logit_processing" and out is batch and hit == list(batch.request_ids)


def ragged_with_tokens(lengths):
    rng = np.random.default_rng(1)
    lr = [-rng.exponential(1.0, n) for n in lengths]
    lt = [np.minimum(x + rng.normal(0.0, 1e-3, x.size), 0.0) for x in lr]
    tokens = [rng.integers(0, 1000, n) for n in lengths]
    return StepBatch.from_ragged(lr, lt, [f"r{i}" for i in range(len(lengths))], tokens=tokens)


class TestOffByOne:
    def test_shifts_train_side_by_one_within_each_sequence(self):
        """Position t of every sequence holds the trainer's logprob and token id of t + 1; the last token keeps its own."""
        batch = ragged_with_tokens([5, 1, 2, 0, 7])
        out, hit = OffByOne().apply(0, batch)
        cu = batch.cu_seqlens
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            if b - a >= 2:
                np.testing.assert_array_equal(out.logp_train[a : b - 1], batch.logp_train[a + 1 : b])
                np.testing.assert_array_equal(out.tokens_train[a : b - 1], batch.tokens[a + 1 : b])
            if b > a:
                assert out.logp_train[b - 1] == batch.logp_train[b - 1] and out.tokens_train[b - 1] == batch.tokens[b - 1]
        assert hit == ["r0", "r2", "r4"]  # every sequence of two tokens or more

    def test_rollout_side_untouched(self):
        """The engine's logprobs and sampled ids stay as they were."""
        batch = synthetic_batch(SMALL, 0)
        out, hit = OffByOne().apply(0, batch)
        np.testing.assert_array_equal(out.logp_rollout, batch.logp_rollout)
        np.testing.assert_array_equal(out.tokens, batch.tokens)
        assert not np.array_equal(out.logp_train, batch.logp_train)
        lengths = np.diff(batch.cu_seqlens)
        assert hit == [rid for rid, n in zip(batch.request_ids, lengths, strict=True) if n >= 2]

    def test_without_tokens_shifts_logprobs_only(self):
        """A batch without token ids gets its trainer logprobs shifted and still no token ids."""
        batch = StepBatch.from_ragged([[-1.0, -2.0, -3.0]], [[-1.0, -2.0, -3.0]], ["a"])
        out, hit = OffByOne().apply(0, batch)
        assert out.logp_train.tolist() == [-2.0, -3.0, -3.0] and out.tokens_train is None and hit == ["a"]

    def test_early_shifts_the_other_way(self):
        """off-by-one-early: position t holds the trainer's logprob and token id of t - 1 (a prompt length
        counted one short); the first token keeps its own."""
        batch = ragged_with_tokens([5, 1, 2, 0, 7])
        out, hit = parse_inject("off-by-one-early").apply(0, batch)
        for a, b in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True):
            if b - a >= 2:
                np.testing.assert_array_equal(out.logp_train[a + 1 : b], batch.logp_train[a : b - 1])
                np.testing.assert_array_equal(out.tokens_train[a + 1 : b], batch.tokens[a : b - 1])
                assert out.logp_train[a] == batch.logp_train[a] and out.tokens_train[a] == batch.tokens[a]
        assert hit == ["r0", "r2", "r4"] and parse_inject("off-by-one-early").cause == "token_misalignment"


class TestBf16Noise:
    def test_changes_only_rollout_logprobs(self):
        """Only logp_rollout moves, on every sequence, and stays a logprob (<= 0)."""
        batch = synthetic_batch(SMALL, 4)
        out, hit = Bf16Noise(scale=2).apply(4, batch)
        np.testing.assert_array_equal(out.logp_train, batch.logp_train)
        np.testing.assert_array_equal(out.cu_seqlens, batch.cu_seqlens)
        np.testing.assert_array_equal(out.tokens, batch.tokens)
        assert out.request_ids == batch.request_ids and hit == list(batch.request_ids)
        assert out.logp_rollout.dtype == batch.logp_rollout.dtype and out.logp_rollout.max() <= 0.0
        assert np.mean(out.logp_rollout != batch.logp_rollout) > 0.9

    def test_noise_grows_with_surprise(self):
        """The noise is scale x 2^-8 x (0.5 + |logp|) per token: larger on improbable tokens, and of that size."""
        batch = synthetic_batch(SMALL, 4)
        lr = batch.logp_rollout.astype(np.float64)
        noise = Bf16Noise(scale=2).apply(4, batch)[0].logp_rollout - lr
        assert np.corrcoef(np.abs(noise), -lr)[0, 1] > 0.5
        assert np.std(noise[lr < -3]) > 5 * np.std(noise[lr > -0.1])
        surprising = lr < -1  # far from 0, where the clip at 0 never bites
        assert np.std(noise[surprising] / (2 * BF16_EPS * (0.5 - lr[surprising]))) == pytest.approx(1.0, abs=0.15)

    def test_deterministic_per_seed_and_step(self):
        """The same (seed, step) gives the same noise; another step or seed gives other noise."""
        batch = synthetic_batch(SMALL, 4)

        def noisy(seed, step):
            return Bf16Noise(scale=1, seed=seed).apply(step, batch)[0].logp_rollout

        np.testing.assert_array_equal(noisy(0, 4), noisy(0, 4))
        assert not np.array_equal(noisy(0, 4), noisy(0, 5))
        assert not np.array_equal(noisy(0, 4), noisy(1, 4))

    def test_the_same_context_rounds_alike(self):
        """With the batch's token and prompt ids, a token scored twice in one context (two samples of a
        prompt sharing their first tokens) gets the same noise, as a real engine's rounding; other tokens
        draw their own, of the documented size."""
        rng = np.random.default_rng(0)
        prompt, head = [1, 2, 3], [7, 8]
        tokens = [np.array(head + rng.integers(10, 900, 30).tolist()) for _ in range(64)]
        lr = [-rng.exponential(2.0, 32) for _ in tokens]
        for x in lr:
            x[:2] = [-0.7, -1.3]  # the twins: the same context, the same logprob
        batch = StepBatch.from_ragged(logp_rollout=lr, logp_train=[x.copy() for x in lr], tokens=tokens, prompt_tokens=[prompt] * 64,
                                      request_ids=[f"r{i}" for i in range(64)])
        noise = (Bf16Noise(scale=1).apply(3, batch)[0].logp_rollout - batch.logp_rollout).reshape(64, 32)
        assert np.ptp(noise[:, 0]) == 0 and np.ptp(noise[:, 1]) == 0 and noise[0, 0] != noise[0, 1]
        rest = noise[:, 2:] / (BF16_EPS * (0.5 - batch.logp_rollout.reshape(64, 32)[:, 2:]))
        assert np.std(rest) == pytest.approx(1.0, abs=0.1) and abs(np.mean(rest)) < 0.1


class TestCorruptSequences:
    @pytest.mark.parametrize("rate, count", [(0.001, 1), (0.05, 3), (0.5, 32), (1.0, 64)])
    def test_touches_rate_of_the_sequences(self, rate, count):
        """max(1, round(rate x N)) distinct sequences are touched, and only those change."""
        batch = synthetic_batch(SMALL, 40)
        out, hit = CorruptSequences(rate=rate).apply(40, batch)
        assert len(hit) == len(set(hit)) == count
        cu = batch.cu_seqlens
        changed = [rid for rid, a, b in zip(batch.request_ids, cu[:-1], cu[1:], strict=True)
                   if not np.array_equal(out.logp_rollout[a:b], batch.logp_rollout[a:b])]
        assert changed == hit
        np.testing.assert_array_equal(out.logp_train, batch.logp_train)

    def test_confident_from_the_first_tokens(self):
        """A touched sequence is rewritten from one of its first three tokens to its end with logprobs in [-0.02, 0]."""
        batch = synthetic_batch(SMALL, 40)
        out, hit = CorruptSequences(rate=0.5).apply(40, batch)
        index = {rid: i for i, rid in enumerate(batch.request_ids)}
        for rid in hit:
            a, b = batch.cu_seqlens[index[rid]], batch.cu_seqlens[index[rid] + 1]
            new, old = out.logp_rollout[a:b], batch.logp_rollout[a:b]
            first = int(np.flatnonzero(new != old)[0])
            assert first < 3
            assert np.all((new[first:] >= -0.02) & (new[first:] <= 0.0))

    def test_deterministic_per_seed_and_step(self):
        """The same (seed, step) picks the same sequences; other steps pick others."""
        batch = synthetic_batch(SMALL, 40)
        picks = [CorruptSequences(rate=0.05).apply(step, batch)[1] for step in (40, 40, 41)]
        assert picks[0] == picks[1] and picks[0] != picks[2]
