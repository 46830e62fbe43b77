"""Quarantine (`rlcheck.core.quarantine`): each rule condemns what it should and nothing else, healthy
bf16 noise is never condemned, and the Monitor with quarantine takes the condemned sequences out of
the step, records and dumps them within the budget, halts past `max_frac` or `patience`, and resumes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from rlcheck import MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core import metrics as K
from rlcheck.core import quarantine_run as QR
from rlcheck.core.quarantine import REASONS, QuarantineConfig, judge
from rlcheck.core.run import files as R
from rlcheck.core.run.dump import quarantine_dir, read_dump
from rlcheck.core.run.journal import read_jsonl
from rlcheck.core.stats import StatsConfig
from rlcheck.core.types import Alarm
from rlcheck.errors import ConfigError

STATS = StatsConfig()
VERSION = 5
"""The weights version of every healthy sequence (the trainer's, in these tests)."""


def healthy(num: int = 40, length: int = 60, seed: int = 0, prefix: str = "s") -> StepBatch:
    """A bf16-like step: |d| ~ 1e-2 on every token, and a 3-nat tail token in every third sequence
    (the first sequence has two, at tokens 0 and 2: too few to be an early divergence; the others
    past token 3, so the step shows no burst of early divergences), on a token the engine found
    uncertain (p <= 0.5: healthy real-loop runs never moved a near-certain one past 0.55 nats,
    benchmarks/data/field_fit.json)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(length // 2, 2 * length, num)  # (N,)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # (N+1,)
    m = int(cu[-1])
    lr = -rng.exponential(1.5, m) - 0.05  # (M,)
    lt = lr + rng.choice([-1.0, 1.0], m) * np.abs(rng.normal(0.0, 1e-2, m))
    for k in range(0, num, 3):
        tails = [0, 2] if k == 0 else [int(rng.integers(4, lens[k]))]  # past the first tokens: no early burst
        lr[cu[k] + tails] = np.minimum(lr[cu[k] + tails], np.log(0.5))
        lt[cu[k] + tails] = lr[cu[k] + tails] - 3.0
    tokens = rng.integers(0, 32000, m)
    return StepBatch.from_packed(lr, np.minimum(lt, 0.0), cu, [f"{prefix}{i}" for i in range(num)],
                                 tokens=tokens, tokens_train=tokens.copy(), weight_version=np.full(num, VERSION))


def with_train(batch: StepBatch, lt: np.ndarray, **kw) -> StepBatch:
    """`batch` with trainer logprobs `lt` (and other fields of `kw`)."""
    fields = dict(tokens=batch.tokens, tokens_train=batch.tokens_train, weight_version=batch.weight_version)
    fields.update(kw)
    return StepBatch.from_packed(batch.logp_rollout, lt, batch.cu_seqlens, batch.request_ids, **fields)


def corrupt(batch: StepBatch, seqs, seed: int = 0) -> StepBatch:
    """The field's corrupt-seqs fault on `seqs`: confident gibberish from one of their first 3 tokens
    (the trainer finds each token 2-4 nats less likely)."""
    rng = np.random.default_rng(seed)
    cu, lt = batch.cu_seqlens, batch.logp_train.copy()
    for k in seqs:
        a, b = int(cu[k]), int(cu[k + 1])
        p = a + int(rng.integers(0, 3))
        lt[p:b] = batch.logp_rollout[p:b] - rng.uniform(2.0, 4.0, b - p)
    return with_train(batch, lt)


def broken(kind: str, batch: StepBatch, k: int) -> tuple[StepBatch, dict]:
    """`batch` with sequence `k` breaking the rule `kind` alone, and the `judge` keywords it needs."""
    a, b = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
    lr, lt = batch.logp_rollout, batch.logp_train.copy()
    if kind == "nonfinite":
        lt[a + 10] = np.nan
    elif kind == "catastrophic":  # 10 tokens at 3 nats from token 20: the rate clause, not early
        lt[a + 20 : a + 30] = lr[a + 20 : a + 30] - 3.0
    elif kind == "early_divergence":  # tokens 0-2 past 0.5, one past 2: too few for the rate clause
        lt[a : a + 3] = lr[a : a + 3] - np.array([1.0, 1.0, 2.5])
    elif kind == "token_mismatch":
        tokens_train = batch.tokens_train.copy()
        tokens_train[a + 5] += 1
        return with_train(batch, lt, tokens_train=tokens_train), {}
    elif kind == "stale_weights":
        versions = batch.weight_version.copy()
        versions[k] = VERSION - 2
        return with_train(batch, lt, weight_version=versions), {"trainer_version": VERSION}
    elif kind == "turn_invariant":  # a cross-turn invariant the Monitor found broken (`rlcheck.core.turn_checks`)
        flags = np.zeros(batch.num_sequences, dtype=bool)
        flags[k] = True
        return batch, {"turn_invariant": flags}
    elif kind in OUTSIDE:
        return batch, {"alarms": OUTSIDE[kind](batch.request_ids[k])}
    assert b - a >= 30
    return with_train(batch, lt), {}


def _guard_alarms(rid: str) -> list[Alarm]:
    from rlcheck.core.run.guard_record import Violation
    from rlcheck.engines.guard.alarms import violations_to_alarms

    return violations_to_alarms(0, [Violation("slot_unique", 3, "7", "slot 2 shared", slot=2, rollout_request_id=rid)],
                                severity="warn")


def _prompt_alarms(rid: str) -> list[Alarm]:
    from rlcheck.core.prompt_ids import alarms_of

    return alarms_of(0, [[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 1, 2, 3]], ["other", rid])


def _audit_alarms(rid: str) -> list[Alarm]:
    """The decode-prefill audit's alarm as `rlcheck.loop.audit.audit_step` builds it."""
    from rlcheck.loop.audit import AUDIT_FAILING, SIGNATURE

    return [Alarm("signature", AUDIT_FAILING, 0, "critical", "decode-prefill audit: 1 of 8 re-scored rollouts differ",
                  {"signature": SIGNATURE, "request_ids": [rid], "num_failing": 1, "num_audited": 8})]


OUTSIDE = {
    "prompt_mismatch": _prompt_alarms, "decode_prefill": _audit_alarms, "guard": _guard_alarms,
    "alarm": lambda rid: [Alarm("threshold", "my/metric", 0, "warn", "the caller's own check", {"request_ids": [rid]})],
}
"""Each outside reason -> the alarms naming one request id, as what raises them builds them."""


class _Died(BaseException):
    """Stands in for the process dying at the patched point (nothing catches it)."""


def _died(*args, **kwargs):
    raise _Died()


def monitor(tmp_path, name: str = "run", **quarantine) -> Monitor:
    return Monitor(MonitorConfig(run_dir=tmp_path / name, sinks=("jsonl",), quarantine=QuarantineConfig(**quarantine)))


class TestJudge:
    @pytest.mark.parametrize("kind", REASONS)
    def test_each_reason_condemns_its_sequence_only(self, kind):
        """A sequence breaking one rule is condemned for that reason alone; every other sequence is kept."""
        batch, kw = broken(kind, healthy(40, 80, seed=1), 17)
        verdict = judge(batch, STATS, QuarantineConfig(), trainer_version=kw.pop("trainer_version", VERSION), **kw)
        assert [(q.index, q.request_id, q.reason, q.reasons) for q in verdict.quarantined] == [(17, "s17", kind, (kind,))]
        assert np.flatnonzero(~verdict.keep).tolist() == [17]
        assert verdict.num_tokens == int(batch.seq_lens[17])

    def test_weights_ahead_of_the_trainer_are_stale(self):
        """A sequence from weights newer than the trainer's is condemned as stale too."""
        batch = healthy(10, 40)
        versions = batch.weight_version.copy()
        versions[3] = VERSION + 1
        verdict = judge(with_train(batch, batch.logp_train, weight_version=versions), STATS, QuarantineConfig(),
                        trainer_version=VERSION)
        assert [(q.index, q.reason) for q in verdict.quarantined] == [(3, "stale_weights")]

    def test_allowed_lag_is_not_stale(self):
        """Within `max_weight_lag` a sequence is kept; without `trainer_version` no version is judged."""
        batch, _ = broken("stale_weights", healthy(10, 40), 3)
        assert judge(batch, STATS, QuarantineConfig(), trainer_version=VERSION, max_weight_lag=2).count == 0
        assert judge(batch, STATS, QuarantineConfig()).count == 0

    @pytest.mark.parametrize("seed", range(5))
    def test_healthy_noise_never_condemned(self, seed):
        """bf16-like noise with the odd 3-nat tail token (two among the first tokens) condemns nothing."""
        verdict = judge(healthy(300, 200, seed=seed), STATS, QuarantineConfig(), trainer_version=VERSION)
        assert verdict.count == 0 and verdict.keep.all() and verdict.metrics()[K.QUARANTINE_COUNT] == 0

    def test_rules_restrict_reasons(self):
        """Only the reasons in `rules` condemn; a sequence breaking several lists those `rules` holds."""
        batch = healthy(40, 80, seed=2)
        kw: dict = {}
        for k, kind in enumerate(REASONS):
            batch, more = broken(kind, batch, 3 * k)
            kw.setdefault("alarms", []).extend(more.get("alarms", ()))
            kw.update({"turn_invariant": more["turn_invariant"]} if "turn_invariant" in more else {})
        both = corrupt(batch, [30])  # catastrophic and early
        only = judge(both, STATS, QuarantineConfig(rules=("nonfinite", "guard")), trainer_version=VERSION, **kw)
        assert [(q.index, q.reason) for q in only.quarantined] == [(0, "nonfinite"), (24, "guard")]
        every = judge(both, STATS, QuarantineConfig(), trainer_version=VERSION, **kw)
        assert [q.index for q in every.quarantined] == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
        assert every.quarantined[-1].reasons == ("catastrophic", "early_divergence")
        late = judge(both, STATS, QuarantineConfig(rules=("early_divergence",)), trainer_version=VERSION, **kw)
        assert [(q.index, q.reason, q.reasons) for q in late.quarantined] == [
            (6, "early_divergence", ("early_divergence",)), (30, "early_divergence", ("early_divergence",))]

    def test_metrics_count_reasons(self):
        """The verdict's metrics count the condemned sequences, their fraction, tokens and reasons."""
        batch = corrupt(healthy(20, 40), [4, 9])
        m = judge(batch, STATS, QuarantineConfig()).metrics()
        assert m[K.QUARANTINE_COUNT] == 2 and m[K.QUARANTINE_FRAC] == pytest.approx(0.1)
        assert m[K.quarantine_reason("catastrophic")] == 2 and m[K.quarantine_reason("guard")] == 0
        assert m[K.QUARANTINE_TOKEN_FRAC] == pytest.approx(batch.seq_lens[[4, 9]].sum() / batch.num_tokens)


class TestQuarantineConfig:
    @pytest.mark.parametrize("kw", [
        {"rules": "nonfinite"}, {"rules": ()}, {"rules": ("nonfinite", "bogus")}, {"max_frac": 1.0},
        {"max_frac": -0.1}, {"max_frac": float("nan")}, {"patience": 0}, {"patience": True}, {"max_dumped": -1},
    ])
    def test_bad_values(self, kw):
        """A value out of range is a ConfigError naming the field."""
        with pytest.raises(ConfigError, match="quarantine"):
            QuarantineConfig(**kw)

    def test_monitor_config_takes_only_a_quarantine_config(self, tmp_path):
        """MonitorConfig(quarantine=...) refuses anything but a QuarantineConfig."""
        with pytest.raises(ConfigError, match="QuarantineConfig"):
            MonitorConfig(run_dir=tmp_path, quarantine={"max_frac": 0.1})


class TestMonitorQuarantine:
    def test_one_corrupted_sequence_in_200(self, tmp_path):
        """The corrupted sequence is taken out: no alarm, no halt, only it unkept, the offenders are the
        rest's with their index in the whole batch, the record lists it and its dump reads back."""
        batch = corrupt(healthy(200, 60, seed=3), [57])
        with monitor(tmp_path) as mon:
            report = mon.observe(0, batch)
        assert report.alarms == [] and not report.halted
        assert np.flatnonzero(~report.keep).tolist() == [57]
        assert [(q.request_id, q.index, q.reason) for q in report.quarantined] == [("s57", 57, "catastrophic")]
        assert report.offenders and all(o.request_id != "s57" for o in report.offenders)
        assert any(o.index > 57 for o in report.offenders)
        seq_max = [float(np.abs(batch.logp_train[a:b] - batch.logp_rollout[a:b]).max())
                   for a, b in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)]
        for o in report.offenders:
            assert batch.request_ids[o.index] == o.request_id and o.max_abs_diff == pytest.approx(seq_max[o.index])
        assert report.metrics[K.SEQ_CATASTROPHIC_COUNT] == 0 and report.metrics[K.QUARANTINE_COUNT] == 1
        record = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
        assert [q["request_id"] for q in record["quarantined"]] == ["s57"]
        where = quarantine_dir(tmp_path / "run", 0)
        assert record["quarantine_dump"] == str(where)
        rows, meta = read_dump(where)
        assert [r["request_id"] for r in rows] == ["s57"] and meta["quarantined"][0]["index"] == 57
        assert not (tmp_path / "run" / "dumps").exists()

    def test_without_quarantine_as_before(self, tmp_path):
        """Quarantine off (the default), the same batch is judged whole: every sequence kept, no
        quarantine metric or record key, the corrupted sequence counted and among the offenders."""
        batch = corrupt(healthy(200, 60, seed=3), [57])
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",))) as mon:
            report = mon.observe(0, batch)
        assert report.keep.all() and report.quarantined == ()
        assert report.offenders[0].request_id == "s57" and report.metrics[K.SEQ_CATASTROPHIC_COUNT] == 1
        assert not any(k.startswith("rlcheck/quarantine/") for k in report.metrics)
        assert "quarantined" not in read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]

    def test_dump_budget_across_steps(self, tmp_path):
        """`max_dumped` sequences are dumped over the run; past it they are listed and counted undumped."""
        with monitor(tmp_path, max_dumped=3) as mon:
            reports = [mon.observe(s, corrupt(healthy(100, 40, seed=s, prefix=f"t{s}-"), [5, 50], seed=s))
                       for s in range(3)]
        assert [r.metrics[K.QUARANTINE_UNDUMPED] for r in reports] == [0, 1, 2]
        assert [r.metrics[K.QUARANTINE_COUNT] for r in reports] == [2, 2, 2]
        assert [row["request_id"] for row in read_dump(quarantine_dir(tmp_path / "run", 0))[0]] == ["t0-5", "t0-50"]
        assert [row["request_id"] for row in read_dump(quarantine_dir(tmp_path / "run", 1))[0]] == ["t1-5"]
        assert not quarantine_dir(tmp_path / "run", 2).exists()
        records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [q["request_id"] for q in records[2]["quarantined"]] == ["t2-5", "t2-50"]
        assert "quarantine_dump" not in records[2]

    def test_no_dump_when_off(self, tmp_path):
        """dump=False writes no quarantine dump; every quarantined sequence counts as undumped."""
        with monitor(tmp_path, dump=False) as mon:
            report = mon.observe(0, corrupt(healthy(100, 40), [5]))
        assert report.metrics[K.QUARANTINE_UNDUMPED] == 1 and not (tmp_path / "run" / "quarantine").exists()

    def test_past_max_frac_halts_judged_whole(self, tmp_path):
        """15% of the sequences condemned (max_frac 0.1): a critical quarantine alarm halts, the step
        is judged whole (its catastrophic count holds them) and the whole batch is dumped."""
        batch = corrupt(healthy(200, 60, seed=4), range(0, 150, 5))
        with monitor(tmp_path) as mon, pytest.raises(MismatchHalt) as info:
            mon.observe(0, batch)
        report = info.value.report
        crit = [a for a in report.alarms if a.kind == "quarantine"]
        assert [(a.severity, a.metric) for a in crit] == [("critical", K.QUARANTINE_FRAC)]
        assert crit[0].details["count"] == 30 and report.metrics[K.SEQ_CATASTROPHIC_COUNT] == 30
        assert info.value.dump_dir is not None and "dumps" in info.value.dump_dir
        rows, meta = read_dump(info.value.dump_dir)
        assert len(rows) == 200 and meta["num_sequences"] == 200

    def test_patience_halts_on_third_step(self, tmp_path):
        """patience=3: quarantine on 3 observed steps in a row halts at the third; a clean step resets."""
        with monitor(tmp_path, patience=3) as mon:
            for s in (0, 1):
                mon.observe(s, corrupt(healthy(100, 40, seed=s), [8]))
            mon.observe(2, healthy(100, 40, seed=2))
            for s in (3, 4):
                mon.observe(s, corrupt(healthy(100, 40, seed=s), [8]))
            assert mon.quarantine.streak == 2
            with pytest.raises(MismatchHalt) as info:
                mon.observe(5, corrupt(healthy(100, 40, seed=5), [8]))
        alarm = [a for a in info.value.report.alarms if a.kind == "quarantine"][0]
        assert alarm.metric == K.QUARANTINE_COUNT and alarm.details["streak"] == 3

    def test_resume_keeps_streak_and_dumped(self, tmp_path):
        """A new Monitor on the same run dir resumes the quarantine streak and the dump budget."""
        with monitor(tmp_path, patience=3, max_dumped=3) as mon:
            for s in (0, 1):
                mon.observe(s, corrupt(healthy(100, 40, seed=s, prefix=f"t{s}-"), [8]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mon = monitor(tmp_path, patience=3, max_dumped=3)
        with mon:
            assert (mon.quarantine.streak, mon.quarantine.dumped) == (2, 2)
            with pytest.raises(MismatchHalt) as info:
                mon.observe(2, corrupt(healthy(100, 40, seed=2, prefix="t2-"), [8, 9]))
        assert info.value.report.metrics[K.QUARANTINE_UNDUMPED] == 1

    def test_resume_after_crash_counts_dumped(self, tmp_path, monkeypatch):
        """A process that died after a step's line but before its state save resumes with that step's
        dumped sequences counted against the budget (and its streak)."""
        first = monitor(tmp_path, max_dumped=3)
        first.observe(0, corrupt(healthy(100, 40, seed=0), [8]))
        monkeypatch.setattr(R, "atomic_write_json", _died)
        with pytest.raises(_Died):
            first.observe(1, corrupt(healthy(100, 40, seed=1), [8, 9]))
        monkeypatch.undo()
        first.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second = monitor(tmp_path, max_dumped=3)
        with second:
            assert (second.quarantine.streak, second.quarantine.dumped) == (2, 3)

    def test_guard_alarm_quarantines_named_sequence(self, tmp_path):
        """An outside alarm naming a request id takes that sequence out and is logged with the step."""
        batch = healthy(50, 40)
        (found,) = _guard_alarms("s7")
        with monitor(tmp_path) as mon:
            report = mon.observe(0, batch, alarms=[found])
        assert np.flatnonzero(~report.keep).tolist() == [7] and report.quarantined[0].reason == "guard"
        assert report.metrics[K.quarantine_reason("guard")] == 1 and found in report.alarms

    def test_outside_alarms_named_for_what_raised_them(self, tmp_path):
        """A prompt-id alarm, the decode-prefill audit's and a weights alarm (verl's fully async lag bound)
        quarantine their sequences as prompt_mismatch, decode_prefill and stale_weights; before, every
        one was "guard"."""
        from rlcheck.core.weights import check_versions

        batch = healthy(50, 40)
        _, weights = check_versions(0, {5: (49, ("s0",)), 2: (1, ("s40",))}, 5, 1)
        alarms = _prompt_alarms("s3") + _audit_alarms("s9") + weights
        with monitor(tmp_path, max_frac=0.2) as mon, pytest.raises(MismatchHalt) as exc:
            mon.observe(0, batch, alarms=alarms)  # the weights alarm halts at once, the verdict is in the report
        report = exc.value.report
        assert [(q.index, q.reason) for q in report.quarantined] == [
            (3, "prompt_mismatch"), (9, "decode_prefill"), (40, "stale_weights")]

    def test_alarms_of_quiet_below_limits(self):
        """No quarantine alarm for a step within max_frac and below patience."""
        verdict = judge(corrupt(healthy(100, 40), [3]), STATS, QuarantineConfig(patience=2))
        assert QR.alarms_of(0, verdict, QuarantineConfig(patience=2), streak=1) == []
        assert len(QR.alarms_of(0, verdict, QuarantineConfig(patience=2), streak=2)) == 1



class TestEarlyShapes:
    def test_a_long_healthy_response_is_not_an_early_divergence(self):
        """One token past 0.5 nats at position 1 and, thousands of tokens later, two more and a 3-nat
        one: healthy bf16 noise in a long response (counted over the whole sequence this was "early
        diverged"); the early clause counts within the first `early_span` tokens only."""
        batch = healthy(4, 40)
        lr, lt, cu = batch.logp_rollout.copy(), batch.logp_train.copy(), batch.cu_seqlens
        long = np.full(5000, -1.0)
        long_t = long.copy()
        long_t[[1, 1500, 2500]] -= 0.7
        long_t[4000] -= 3.0
        lr = np.concatenate([lr, long])
        lt = np.concatenate([lt, long_t])
        cu = np.concatenate([cu, [cu[-1] + 5000]])
        b = StepBatch.from_packed(lr, lt, cu, [*batch.request_ids, "long"])
        assert judge(b, STATS, QuarantineConfig()).count == 0
        garbled = long.copy()
        garbled[[0, 2, 5]] -= 0.8
        garbled[3] -= 2.5  # the first tokens garbled: early, within the span
        b = StepBatch.from_packed(np.concatenate([batch.logp_rollout, long]),
                                  np.concatenate([batch.logp_train, garbled]), cu, [*batch.request_ids, "long"])
        v = judge(b, STATS, QuarantineConfig())
        assert [q.request_id for q in v.quarantined] == ["long"] and v.quarantined[0].reason == "early_divergence"

    def test_a_recurring_burst_of_mild_early_divergences_halts(self, tmp_path):
        """The engine's stale-state shape: 40% of the sequences diverge at their first token by 1.5
        nats, one token each, too mild for the per-sequence rule; the step's burst of early
        divergences condemns them all, past max_frac. Once, a warning (the step judged whole, as the
        signature detector warns on one burst: a healthy 1,024-token run had one); again within the
        detector's window, the critical quarantine alarm halts."""
        def burst(seed: int) -> StepBatch:
            batch = healthy(50, 40, seed=seed, prefix=f"b{seed}-")
            lt = batch.logp_train.copy()
            hit = list(range(0, 50, 5)) + list(range(1, 50, 5))  # 20 of 50
            lt[batch.cu_seqlens[hit]] = batch.logp_rollout[batch.cu_seqlens[hit]] - 1.5
            return with_train(batch, np.minimum(lt, 0.0))

        v = judge(burst(0), STATS, QuarantineConfig())
        assert v.count == v.burst_only == 20 and {q.reason for q in v.quarantined} == {"early_divergence"}
        with monitor(tmp_path) as mon:
            first = mon.observe(0, burst(0))
            (alarm,) = [a for a in first.alarms if a.kind == "quarantine"]
            assert alarm.severity == "warn" and not first.halted and alarm.details["bursts"] == 1
            assert first.metrics[K.SEQ_COUNT] == 50  # judged whole
            with pytest.raises(MismatchHalt) as halt:
                mon.observe(1, burst(1))
        assert any(a.kind == "quarantine" and a.severity == "critical" for a in halt.value.report.alarms)


class TestBurstResume:
    def test_a_burst_before_a_crash_still_counts(self, tmp_path):
        """A burst step logged by a process killed before its state save: the resumed Monitor's
        catch-up counts it, so the next burst is its recurrence and halts."""
        def burst(seed: int) -> StepBatch:
            batch = healthy(50, 40, seed=seed, prefix=f"c{seed}-")
            lt = batch.logp_train.copy()
            hit = list(range(0, 50, 5)) + list(range(1, 50, 5))
            lt[batch.cu_seqlens[hit]] = batch.logp_rollout[batch.cu_seqlens[hit]] - 1.5
            return with_train(batch, np.minimum(lt, 0.0))

        mon = monitor(tmp_path)
        mon.observe(0, healthy(50, 40, seed=9, prefix="h-"))
        state = (tmp_path / "run" / R.STATE_FILE).read_bytes()
        mon.observe(1, burst(0))  # warns; then the process dies before ...
        mon.close()
        (tmp_path / "run" / R.STATE_FILE).write_bytes(state)  # ... its state save
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = monitor(tmp_path)
        assert again.quarantine.bursts == [2] and again.quarantine.observed == 2
        with pytest.raises(MismatchHalt):
            again.observe(2, burst(1))
        again.close()
