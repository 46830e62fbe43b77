"""`rlcheck diagnose` on run directories the real Monitor wrote from synthetic step streams: a clean run is
healthy, and each failure shape (the data-level faults from step 32, when the rolling detectors are warm,
a periodic spike, a growing mismatch, a temperature slope) is named with its steps and requests; a halt
dump on its own gives the same cause; the JSON shape and the console rendering; bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.detect.signature import SignatureConfig
from rlcheck.core.floors import Precision
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.stats import StatsConfig
from rlcheck.errors import InputError, MismatchHalt
from rlcheck.faults import parse_inject
from rlcheck.forensics.diagnose import CAUSES, diagnose
from rlcheck.forensics.diagnose.evidence import Evidence, load_evidence
from rlcheck.forensics.diagnose.rules.engine import sparse_sequences
from rlcheck.forensics.render import render_diagnosis
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

ONSET = 32
STEPS = 45
NOISE = {"fp32": 2e-6, "bf16": 2e-3}
"""The synthetic steps' noise (std of d at logp = -1) at each precision pair the Monitor is told of."""
PAIRS = {"fp32": Precision("float32", "float32"), "bf16": Precision("bfloat16", "float32")}
PAIR = {"now": "bf16"}
"""The pair of the run being recorded (the `runs` fixture sets it)."""


def data() -> SyntheticConfig:
    return SyntheticConfig(num_sequences=64, mean_length=64, noise=NOISE[PAIR["now"]])


def spikes() -> SyntheticConfig:
    """A spike every 3 steps from the first, twice the noise: a sync left out every 3 updates."""
    return dataclasses.replace(data(), spike_every=3, spike_scale=2.0)
"""A spike every 3 steps from the first, twice the noise: a sync left out every 3 updates."""


def growing(step: int) -> StepBatch:
    """Noise that grows by its clean level every step from ONSET on (14x at step 44): stale weights."""
    factor = 1.0 + max(0, step - ONSET + 1)
    return synthetic_batch(dataclasses.replace(data(), noise=data().noise * factor), step)


def hotter(step: int) -> StepBatch:
    """The trainer's logprobs 1.1x the engine's from the first step: a temperature mismatch's slope."""
    batch = synthetic_batch(data(), step)
    return dataclasses.replace(batch, logp_train=batch.logp_train * np.float32(1.1))


@dataclasses.dataclass
class Run:
    path: Path
    touched: dict[int, list[str]]
    """step -> request ids the fault touched (ground truth)."""
    halt: MismatchHalt | None
    far_off: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """step -> the touched request ids that are catastrophic by the default's rate (`far_off`)."""


def far_off(batch: StepBatch, ids: list[str], cfg: StatsConfig = StatsConfig()) -> list[str]:
    """Of the request ids `ids`, those whose sequence has at least `catastrophic_min_frac` of its
    tokens, and `catastrophic_min_tokens`, at |d| >= catastrophic_tau (an independent count, token by
    token; these batches have no mask and no non-finite logprob)."""
    out = []
    for rid in ids:
        i = batch.request_ids.index(rid)
        a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        d = [float(t) - float(r) for r, t in zip(batch.logp_rollout[a:b], batch.logp_train[a:b], strict=True)]
        over = sum(1 for x in d if abs(x) >= cfg.catastrophic_tau)
        if over >= cfg.catastrophic_min_tokens and over >= cfg.catastrophic_min_frac * len(d):
            out.append(rid)
    return out


def record(run_dir: Path, make_batch, spec: str | None = None, steps: int = STEPS) -> Run:
    """Feed the Monitor `make_batch(step)` with the fault `spec` applied, until the steps end or it halts."""
    fault, touched, halt = parse_inject(spec), {}, None
    catastrophic = {}
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), precision=PAIRS[PAIR["now"]])) as mon:
        for step in range(steps):
            batch, touched[step] = fault.apply(step, make_batch(step))
            catastrophic[step] = far_off(batch, touched[step])
            try:
                mon.observe(step, batch)
            except MismatchHalt as exc:
                halt = exc
                break
    return Run(run_dir, touched, halt, catastrophic)


CASES = {
    "clean": lambda d: record(d, lambda s: synthetic_batch(data(), s)),
    "corrupt": lambda d: record(d, lambda s: synthetic_batch(data(), s), f"corrupt-seqs=0.02@{ONSET}"),
    "off_by_one": lambda d: record(d, lambda s: synthetic_batch(data(), s), f"off-by-one@{ONSET}"),
    "off_by_one_early": lambda d: record(d, lambda s: synthetic_batch(data(), s), f"off-by-one-early@{ONSET}"),
    "bf16": lambda d: record(d, lambda s: synthetic_batch(data(), s), f"bf16-noise=2@{ONSET}"),
    "periodic": lambda d: record(d, lambda s: synthetic_batch(spikes(), s), steps=60),
    "growing": lambda d: record(d, growing),
    "temperature": lambda d: record(d, hotter),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """`recorded(name, pair) -> Run`: the run of CASES[name] at a precision pair, recorded on first use and
    shared by the module."""
    done: dict[tuple[str, str], Run] = {}

    def get(name: str, pair: str) -> Run:
        if (name, pair) not in done:
            PAIR["now"] = pair
            done[name, pair] = CASES[name](tmp_path_factory.mktemp(f"{name}-{pair}"))
            PAIR["now"] = "bf16"
        return done[name, pair]

    return get


@pytest.fixture(params=sorted(PAIRS))
def runs(request, recorded):
    """`runs(name) -> Run`: CASES[name] at the test's precision pair (the tests run at both: the fp32 steps'
    noise 1000x smaller, the faults the same size)."""
    return lambda name: recorded(name, request.param)


class TestDiagnose:
    def test_clean_run_is_healthy(self, runs):
        """45 clean steps: the verdict is healthy, alone, with no step or request named."""
        result = diagnose(runs("clean").path)
        assert result.healthy and [f.cause for f in result.findings] == ["healthy"]
        assert result.source == "run" and result.num_steps == STEPS
        assert result.verdict.affected_steps == [] and result.verdict.affected_request_ids == []

    def test_healthy_says_what_its_floor_hides(self, recorded):
        """A healthy bf16 run's verdict says it was judged at the bf16 floor and how to see below it (a fault
        within bf16's noise, as the trained hybrid's one-token left padding, reads healthy there); a fp32 run's
        verdict needs no such line."""
        bf16 = diagnose(recorded("clean", "bf16").path).verdict
        assert bf16.cause == "healthy" and len(bf16.evidence) == 2
        assert "bfloat16 floor" in bf16.evidence[1] and "float32" in bf16.evidence[1]
        fp32 = diagnose(recorded("clean", "fp32").path).verdict
        assert fp32.cause == "healthy" and len(fp32.evidence) == 1

    def test_corrupt_sequences_are_stale_state(self, runs):
        """Corrupted sequences are stale state, from the first step one of them is catastrophic (a tenth
        of its tokens at |d| >= 2: the fault's confident rollout logprobs are that far off only where the
        trainer's token was unlikely), naming exactly the catastrophic touched requests."""
        run = runs("corrupt")
        verdict = diagnose(run.path).verdict
        assert run.halt is not None  # recurring far-off sequences are critical: a halt ends the run
        assert verdict.cause == "stale_state", verdict.evidence
        caught = [s for s in sorted(run.far_off) if run.far_off[s]]
        assert caught and caught[0] >= ONSET and caught[-1] == run.halt.report.step
        assert verdict.affected_steps == caught
        assert sorted(verdict.affected_request_ids) == sorted(rid for ids in run.far_off.values() for rid in ids)
        assert set(verdict.affected_request_ids) <= {rid for ids in run.touched.values() for rid in ids}

    @pytest.mark.parametrize("case", ["off_by_one", "off_by_one_early"])
    def test_off_by_one_is_token_misalignment(self, runs, case):
        """A one-token shift, read one token late or one early (a prompt length counted one short), is
        token misalignment at the step it starts, among the requests it shifted. Before, the early one
        read as `retokenization` (the ids part at the second token, not the first)."""
        run = runs(case)
        verdict = diagnose(run.path).verdict
        assert verdict.cause == "token_misalignment", verdict.evidence
        assert verdict.affected_steps == [ONSET] and run.halt.report.step == ONSET
        assert verdict.affected_request_ids and set(verdict.affected_request_ids) <= set(run.touched[ONSET])

    def test_bf16_noise_is_numeric_noise(self, runs):
        """Rollout noise at twice the synthetic level is numeric noise, with no affected step before it started."""
        run = runs("bf16")
        verdict = diagnose(run.path).verdict
        assert run.halt is None
        assert verdict.cause == "numeric_noise", verdict.evidence
        assert verdict.affected_steps and min(verdict.affected_steps) >= ONSET

    def test_periodic_spikes_are_weights_out_of_sync(self, runs):
        """A spike every 3 steps is weights out of sync, naming the period and only spiked steps."""
        run = runs("periodic")
        verdict = diagnose(run.path).verdict
        assert run.halt is not None and "periodic" in run.halt.reason
        assert verdict.cause == "weights_out_of_sync", verdict.evidence
        assert "every 3 steps" in verdict.evidence[0]
        assert len(verdict.affected_steps) >= 10 and all(s % 3 == 0 for s in verdict.affected_steps)
        assert verdict.affected_request_ids

    def test_growing_mismatch_is_weights_out_of_sync(self, runs):
        """A mismatch that grows step after step from ONSET is weights out of sync, and the evidence says it grows."""
        verdict = diagnose(runs("growing").path).verdict
        assert verdict.cause == "weights_out_of_sync", verdict.evidence
        assert any("grows" in line for line in verdict.evidence)
        assert min(verdict.affected_steps) >= ONSET and verdict.affected_steps[-1] == STEPS - 1

    def test_temperature_slope_is_logit_processing(self, runs):
        """logp_train = 1.1 x logp_rollout is a logit-processing mismatch, seen on every step until the
        lasting slope turns critical and halts the run, with slope ~0.1."""
        run = runs("temperature")
        lasting = SignatureConfig().slope_critical_after
        assert run.halt is not None and run.halt.report.step == lasting - 1 and "slope" in run.halt.reason
        verdict = diagnose(run.path).verdict
        assert verdict.cause == "logit_processing", verdict.evidence
        assert verdict.affected_steps == list(range(lasting))
        assert "median slope 0.100" in verdict.evidence[0]

    @pytest.mark.parametrize("name, cause", [("corrupt", "stale_state"), ("off_by_one", "token_misalignment")])
    def test_halt_dump_alone_gives_the_same_cause(self, runs, name, cause):
        """The dump a halt wrote, diagnosed on its own, names the run's cause at the halted step."""
        run = runs(name)
        result = diagnose(run.halt.dump_dir)
        step = run.halt.report.step
        assert result.source == "dump" and result.num_steps == 1
        assert result.verdict.cause == cause == diagnose(run.path).verdict.cause
        assert result.verdict.affected_steps == [step]
        assert set(result.verdict.affected_request_ids) <= set(run.touched[step])

    def test_findings_ranked_by_confidence(self, runs):
        """Every finding is a known cause, the verdict is the most confident one."""
        result = diagnose(runs("temperature").path)
        confidences = [f.confidence for f in result.findings]
        assert confidences == sorted(confidences, reverse=True)
        assert all(f.cause in CAUSES for f in result.findings)


class TestCatastrophicRequests:
    """The requests a sparse-catastrophic finding names are catastrophic as the statistics count them."""

    @staticmethod
    def _evidence(rows: list[dict], offenders: list[dict], count: int) -> Evidence:
        alarm = {"kind": "signature", "metric": "rlcheck/seq/catastrophic_count", "step": 5, "severity": "warn",
                 "message": "far off", "details": {"signature": "sparse_catastrophic", "count": count}}
        records = [{"step": s, "metrics": {}, "alarms": [alarm] if s == 5 else [], "offenders": offenders if s == 5 else []}
                   for s in range(6)]
        return Evidence("run", Path("."), records, {5: rows} if rows else {})

    def test_dump_rows_by_rate_of_tokens(self):
        """From a dump: a sequence with 3 of 20 tokens at |d| >= 2 is named, one with a single tail token at
        |d| = 8 (max |d| far above 2) is not, one with a NaN among its compared tokens is, and tokens masked
        out never count."""
        clean = [-0.5] * 20
        tail = clean[:9] + [-8.5] + clean[10:]
        rate = [-3.0] * 3 + clean[3:]
        masked = [-9.0] * 10 + clean[10:]
        nan = clean[:4] + [float("nan")] + clean[5:]
        rows = [{"request_id": rid, "logp_rollout": clean, "logp_train": lt, "max_abs_diff": mx,
                 **({"mask": [False] * 10 + [True] * 10} if rid == "masked" else {})}
                for rid, lt, mx in [("tail", tail, 8.0), ("rate", rate, 2.5), ("masked", masked, 0.0),
                                    ("nan", nan, 0.0), ("clean", clean, 0.0)]]
        finding = sparse_sequences(self._evidence(rows, [], count=2))
        assert finding.affected_steps == [5] and finding.affected_request_ids == ["rate", "nan"]

    def test_offenders_only(self):
        """Without a dump, from the logged offenders: the worst at max |d| >= 2, as many as the signature counted."""
        offenders = [{"request_id": f"r{i}", "max_abs_diff": mx, "nonfinite": False}
                     for i, mx in enumerate([9.0, 4.0, 2.5, 1.9])]
        finding = sparse_sequences(self._evidence([], offenders, count=2))
        assert finding.affected_request_ids == ["r0", "r1"]
        assert sparse_sequences(self._evidence([], offenders, count=5)).affected_request_ids == ["r0", "r1", "r2"]


class TestDiagnosis:
    @pytest.mark.parametrize("name", ["clean", "corrupt", "temperature"])
    def test_to_dict_is_json(self, runs, name):
        """`to_dict()` is plain JSON: source, path, steps, the verdict first among the findings, confidences in [0, 1]."""
        result = diagnose(runs(name).path)
        d = json.loads(json.dumps(result.to_dict(), allow_nan=False))
        assert d["source"] == "run" and d["path"] == str(runs(name).path) and d["num_steps"] == result.num_steps
        assert d["verdict"] == d["findings"][0] and d["verdict"]["cause"] == result.verdict.cause
        for f in d["findings"]:
            assert set(f) == {"cause", "title", "confidence", "evidence", "affected_steps", "affected_request_ids"}
            assert 0.0 <= f["confidence"] <= 1.0 and f["title"] == CAUSES[f["cause"]]
            assert f["evidence"] and all(isinstance(line, str) for line in f["evidence"])


class TestLoadEvidence:
    def test_neither_run_nor_dump(self, tmp_path):
        """A directory with neither metrics.jsonl nor a dump's files is an InputError saying what it expected."""
        (tmp_path / "notes.txt").write_text("hello")
        with pytest.raises(InputError, match="neither a run directory"):
            diagnose(tmp_path)

    def test_empty_metrics(self, tmp_path):
        """A metrics.jsonl with no complete step record is an InputError."""
        (tmp_path / "metrics.jsonl").write_text("")
        with pytest.raises(InputError, match="no complete step record"):
            load_evidence(tmp_path)

    def test_records_missing_a_key(self, runs, tmp_path):
        """Records that lack some metrics (an older writer, a hand-edited file) still get a verdict, the same one."""
        src = runs("bf16").path / "metrics.jsonl"
        lines = [json.loads(x) for x in src.read_text().splitlines()]
        for rec in lines[::3]:
            rec.get("metrics", {}).pop("rlcheck/token/diff_mean", None)
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        assert diagnose(tmp_path).verdict.cause == "numeric_noise"

    def test_run_reads_its_dumps(self, runs):
        """A run's evidence holds its records in step order and the rows of its halt dump, one per sequence."""
        run = runs("corrupt")
        ev = load_evidence(run.path)
        step = run.halt.report.step
        assert [r["step"] for r in ev.records] == list(range(step + 1))
        assert list(ev.dump_rows) == [step] and len(ev.dump_rows[step]) == data().num_sequences


class TestRenderDiagnosis:
    def test_names_cause_evidence_and_requests(self, runs):
        """The console output names the likely cause, its evidence and the affected requests."""
        run = runs("corrupt")
        result = diagnose(run.path)
        console = Console(record=True, width=300)
        render_diagnosis(result, console)
        text = console.export_text()
        assert f"likely cause: {CAUSES['stale_state']}" in text
        assert result.verdict.evidence[0] in text
        assert all(rid in text for rid in result.verdict.affected_request_ids)

    def test_evidence_printed_as_written(self, runs):
        """Evidence that quotes array indices (`logp_rollout[t+1]`) is printed literally, not read as markup."""
        console = Console(record=True, width=300)
        render_diagnosis(diagnose(runs("off_by_one").path), console)
        assert "logp_train[t] matches logp_rollout[t+1]" in console.export_text()

    def test_healthy(self, runs):
        """A healthy run prints the healthy verdict and lists no request."""
        console = Console(record=True, width=300)
        render_diagnosis(diagnose(runs("clean").path), console)
        text = console.export_text()
        assert "likely cause: healthy" in text and "affected requests" not in text


class TestQuarantineNote:
    def test_quarantined_sequences_are_named_in_the_evidence(self, tmp_path):
        """A run that quarantined a corrupted sequence: healthy (of the kept sequences), and the
        evidence says how many were quarantined, why, and where they are."""
        from rlcheck.core.quarantine import QuarantineConfig

        rng = np.random.default_rng(0)
        with Monitor(MonitorConfig(tmp_path, sinks=(), quarantine=QuarantineConfig())) as mon:
            for step in range(3):
                lr = [-rng.uniform(0.1, 3, 30) for _ in range(50)]
                lt = [np.minimum(x + rng.normal(0, 1e-3, 30), 0) for x in lr]
                if step == 1:
                    lr[4], lt[4] = np.full(30, -0.001), np.full(30, -4.0)
                mon.observe(step, StepBatch.from_ragged(logp_rollout=lr, logp_train=lt,
                                                        request_ids=[f"s{step}-{i}" for i in range(50)]))
        verdict = diagnose(tmp_path).verdict
        assert verdict.cause == "healthy"
        note = [e for e in verdict.evidence if "quarantined" in e]
        assert note and "1 sequence(s) quarantined on 1 step(s) from step 1: 1 catastrophic" in note[0]
        assert str(tmp_path / "quarantine") in note[0]


class TestSecondaryCause:
    def test_no_noise_after_one_weights_alarm(self, tmp_path):
        """A halt on a weights alarm after healthy steps names weights alone: the alarm step is no
        evidence of numeric noise (one step is not a persistent rise)."""
        run_dir = tmp_path / "stale"
        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
            for step in range(6):
                mon.observe(step, synthetic_batch(data(), step))
            stale = synthetic_batch(data(), 6)
            stale = StepBatch.from_packed(stale.logp_rollout, stale.logp_train, stale.cu_seqlens,
                                          stale.request_ids, weight_version=3)
            with pytest.raises(MismatchHalt):
                mon.observe(6, stale, trainer_version=6)
        causes = [f.cause for f in diagnose(run_dir).findings]
        assert causes == ["weights_out_of_sync"]


class TestShortRuns:
    @pytest.mark.parametrize("pair", sorted(PAIRS))
    def test_noise_from_the_first_step_over_three_steps(self, tmp_path, pair):
        """Rounding noise on the engine from step 0, three steps (the run `rlcheck demo --inject bf16-noise=X` gives
        before it stops): one threshold warning (the gate re-arms) and every step past the gate at the run's floor:
        numeric_noise. bf16-sized noise on a fp32 pair; on a bf16 engine, 16x its own (4x is within its floor)."""
        PAIR["now"] = pair
        spec = "bf16-noise=1" if pair == "fp32" else "bf16-noise=16"
        try:
            run = record(tmp_path, lambda s: synthetic_batch(data(), s), spec, steps=3)
        finally:
            PAIR["now"] = "bf16"
        v = diagnose(run.path).verdict
        assert v.cause == "numeric_noise" and v.affected_steps == [0, 1, 2], v.evidence

    def test_noise_past_the_probability_gate_alone(self, tmp_path):
        """Recorded on the trained hybrid with a bf16 engine and the DeepSpeed trainer (`bench_confusion.py --trainers
        deepspeed`, `bf16-noise=16`, seed 1): the probability gate warns at step 0 and every step stays past it, while
        the clipped mean (0.02-0.05) stays under its 0.05 gate: numeric_noise over the three steps, not 'no known
        shape' (the steps past a gate counted on the clipped mean alone left one step)."""
        keys = (K.ABS_DIFF_MEAN, K.ABS_DIFF_CLIPPED_MEAN, K.PROB_ABS_DIFF_MEAN, K.DIFF_MEAN, K.ABS_DIFF_P50)
        figures = [(0.02198, 0.02198, 0.01993, 0.01222, 0.01453), (0.02779, 0.02779, 0.01286, 0.00759, 0.00507),
                   (0.05033, 0.04861, 0.02049, -0.00382, 0.02367)]
        alarm = {"kind": "threshold", "metric": K.PROB_ABS_DIFF_MEAN, "step": 0, "severity": "warn",
                 "message": "rlcheck/token/prob_abs_diff_mean = 0.01993 > 0.01", "details": {"value": 0.01993, "limit": 0.01}}
        lines = [{"step": step, "metrics": {**dict(zip(keys, row, strict=True)), K.FLOOR_LEVEL: 0.01, K.FLOOR_SCALE: 1.0},
                  "alarms": [alarm] if step == 0 else []} for step, row in enumerate(figures)]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        v = diagnose(tmp_path).verdict
        assert v.cause == "numeric_noise" and v.affected_steps == [0, 1, 2], v.evidence
