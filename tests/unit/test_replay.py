"""Replay's pure parts on synthetic arrays: per-request divergence, ranking, the context window, the
JSON records, and the dump checks that need no model."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcheck.core.batch import StepBatch
from rlcheck.core.run.dump import SEQUENCES, write_dump
from rlcheck.errors import InputError
from rlcheck.forensics.replay import (
    DEFAULT_THRESHOLD,
    ReplayReport,
    check_dump_dir,
    check_vocab,
    load_sequences,
    resolve_model,
    resolve_temperature,
)
from rlcheck.forensics.replay.ranking import (
    Context,
    ReplayRecord,
    compare,
    context_window,
    printable,
    rank,
    with_context,
)


def arrays(*values):
    return [np.asarray(v, dtype=np.float64) for v in values]


def record(request_id="r", index=0, max_abs_diff=0.0, nonfinite=False, first=None, **kw):
    return ReplayRecord(request_id=request_id, index=index, length=5, max_abs_diff=max_abs_diff,
                        max_abs_diff_train=None, first_divergence=first, max_position=0, mean_diff=0.0,
                        nonfinite=nonfinite, **kw)


def report(records, threshold=DEFAULT_THRESHOLD):
    return ReplayReport(dump_dir="d", model="m", step=3, temperature=1.0, temperature_from="default",
                        threshold=threshold, tau=0.5, batched=True, records=tuple(records), num_tokens=10,
                        num_scored_tokens=20, score_seconds=0.1, load_seconds=0.2, padding_fraction=0.0)


class TestCompare:
    def test_max_first_divergence_and_peak(self):
        """max |d| over the tokens, the first position past tau, the position of the largest |d| and mean d."""
        ref = arrays([-1.0, -1.0, -1.0, -1.0, -1.0], [-2.0, -2.0])
        roll = arrays([-1.0, -1.2, -0.01, -3.0, -1.0], [-2.0, -2.0 + 1e-6])
        a, b = compare(["a", "b"], ref, roll, tau=0.5)
        assert a.max_abs_diff == pytest.approx(2.0) and a.first_divergence == 2 and a.max_position == 3
        assert a.mean_diff == pytest.approx((0 + 0.2 - 0.99 + 2.0 + 0) / 5)
        assert b.first_divergence is None and b.max_abs_diff == pytest.approx(1e-6)
        assert (a.length, b.length, a.index, b.index) == (5, 2, 0, 1)

    def test_nonfinite_and_sentinels_diverge(self):
        """A -inf, NaN or -1e9 rollout logprob marks its sequence non-finite and diverged at that token;
        max |d| stays over the finite tokens."""
        ref = arrays([-1.0, -1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0])
        roll = arrays([-1.1, -np.inf, -1.0], [-1.0, -1e9], [np.nan, -1.0])
        recs = compare(["x", "y", "z"], ref, roll, tau=0.5)
        assert [r.nonfinite for r in recs] == [True, True, True]
        assert [r.first_divergence for r in recs] == [1, 1, 0]
        assert recs[0].max_abs_diff == pytest.approx(0.1)
        assert all(math.isfinite(r.mean_diff) for r in recs)

    def test_trainer_side_and_mask(self):
        """The trainer is compared with the reference too; masked-out tokens count nowhere."""
        ref = arrays([-1.0, -1.0, -1.0])
        roll = arrays([-1.0, -9.0, -1.0])
        train = arrays([-1.0, -1.0, -1.3])
        (r,) = compare(["a"], ref, roll, train, tau=0.5)
        assert r.max_abs_diff == pytest.approx(8.0) and r.max_abs_diff_train == pytest.approx(0.3)
        (m,) = compare(["a"], ref, roll, train, tau=0.5, valid=[np.array([True, False, True])])
        assert m.max_abs_diff == 0.0 and m.first_divergence is None and not m.nonfinite
        (n,) = compare(["a"], ref, roll, tau=0.5)
        assert n.max_abs_diff_train is None

    def test_empty_sequences_and_indices(self):
        """An empty response is a clean record of length 0; dump indices are carried."""
        recs = compare(["e", "f"], arrays([], [-1.0]), arrays([], [-3.0]), tau=0.5, indices=[7, 9])
        assert (recs[0].length, recs[0].max_abs_diff, recs[0].max_position, recs[0].index) == (0, 0.0, None, 7)
        assert (recs[1].first_divergence, recs[1].index) == (0, 9)


class TestRank:
    def test_worst_first(self):
        """Non-finite first, then by max |d| descending, ties by dump index."""
        recs = [record("a", 0, 0.1), record("b", 1, 3.0), record("c", 2, 0.2, nonfinite=True),
                record("d", 3, 3.0), record("e", 4, 0.0)]
        assert [r.request_id for r in rank(recs)] == ["c", "b", "d", "a", "e"]


class TestContextWindow:
    def test_middle_start_and_end(self):
        """Up to `width` ids each side; the window reaches back into the prompt, not past the response."""
        prompt, resp = [1, 2, 3], [10, 11, 12, 13, 14, 15]
        assert context_window(prompt, resp, 3, 2) == ([11, 12], 13, [14, 15])
        assert context_window(prompt, resp, 0, 2) == ([2, 3], 10, [11, 12])
        assert context_window(prompt, resp, 5, 4) == ([11, 12, 13, 14], 15, [])
        assert context_window([1], resp, 0, 4) == ([1], 10, [11, 12, 13, 14])

    def test_outside_raises(self):
        """A position outside the response is a bug, not a silent empty window."""
        with pytest.raises(IndexError):
            context_window([1], [2, 3], 2)

    def test_with_context_decodes_and_marks(self):
        """The divergent token is decoded and marked between its neighbours, with both logprobs."""
        rec = record(first=1)
        out = with_context(rec, [5], [6, 7, 8], np.array([-1.0, -4.0, -1.0]), np.array([-1.0, -0.01, -1.0]),
                           decode=lambda ids: "".join(chr(96 + i) for i in ids))
        ctx = out.context
        assert (ctx.position, ctx.token_id, ctx.token, ctx.before, ctx.after) == (1, 7, "g", "ef", "h")
        assert (ctx.logp_rollout, ctx.logp_reference) == (-0.01, -4.0)
        assert ctx.marked == "ef⟦g⟧h"
        assert with_context(record(), [5], [6], np.zeros(1), np.zeros(1), decode=str) == record()

    def test_printable(self):
        """Newlines and tabs are escaped so a context stays on one table line."""
        assert printable("a\nb\tc") == "a\\nb\\tc"
        assert printable("é ⟦x⟧") == "é ⟦x⟧"


class TestJSON:
    def test_record_shape(self):
        """A record is plain strict JSON: the documented keys, non-finite floats as strings."""
        ctx = Context(position=3, token_id=9, token="x", before="ab", after="\n", logp_rollout=-math.inf,
                      logp_reference=-2.0)
        d = record("r1", 4, 2.5, first=3, context=ctx).to_dict()
        json.dumps(d, allow_nan=False)
        assert {"request_id", "index", "length", "max_abs_diff", "max_abs_diff_train", "first_divergence",
                "mean_diff", "nonfinite", "context"} <= d.keys()
        assert d["context"]["logp_rollout"] == "-Infinity" and d["context"]["marked"] == "ab⟦x⟧\\n"
        assert record().to_dict()["context"] is None

    def test_report_failed_and_top(self):
        """`failed` holds the requests over the threshold (non-finite always); to_json keeps the order."""
        recs = rank([record("ok", 0, 0.1), record("bad", 1, 0.9), record("nan", 2, 0.0, nonfinite=True)])
        rep = report(recs)
        assert [r.request_id for r in rep.failed] == ["nan", "bad"]
        assert [r["request_id"] for r in rep.to_json()] == ["nan", "bad", "ok"]
        assert [r["request_id"] for r in rep.to_json(top=1)] == ["nan"]
        assert report([record("ok", 0, 0.1)]).failed == ()


def write(tmp_path, redact=False, context=None, name="step_000003"):
    batch = StepBatch.from_ragged(
        logp_rollout=[np.array([-1.0, -2.0]), np.array([-0.5])],
        logp_train=[np.array([-1.0, -2.0]), np.array([-0.5])],
        request_ids=["a", "b"],
        tokens=[np.array([5, 6]), np.array([7])],
        prompt_tokens=[np.array([1, 2]), np.array([3])],
    )
    return write_dump(tmp_path / "run" / "dumps" / name, batch, step=3, redact=redact, context=context)


class TestDumpChecks:
    def test_reads_sequences(self, tmp_path):
        """Tokens, both logprob arrays and the dump indices come back in dump order."""
        seqs = load_sequences(write(tmp_path))
        assert seqs.request_ids == ["a", "b"] and seqs.indices == [0, 1]
        assert seqs.prompts == [[1, 2], [3]] and seqs.responses == [[5, 6], [7]]
        assert seqs.logp_train is not None and seqs.valid is None

    def test_run_dir_is_not_a_dump(self, tmp_path):
        """A run directory is refused with what a dump directory is and the dumps it holds."""
        write(tmp_path)
        with pytest.raises(InputError, match=r"not a dump directory.*dumps/step_NNNNNN.*step_000003"):
            check_dump_dir(tmp_path / "run")
        with pytest.raises(InputError, match="not a dump directory"):
            check_dump_dir(tmp_path)

    def test_redacted(self, tmp_path):
        """A redacted dump has no tokens to replay: a clear InputError."""
        with pytest.raises(InputError, match="no token ids.*redact"):
            load_sequences(write(tmp_path, redact=True))

    def test_mismatched_lengths(self, tmp_path):
        """Response tokens and rollout logprobs of different lengths name the request."""
        path = write(tmp_path)
        table = pq.read_table(path / SEQUENCES)
        tokens = pa.array([[5, 6, 9], [7]], type=pa.large_list(pa.int64()))
        pq.write_table(table.set_column(table.schema.get_field_index("response_tokens"), "response_tokens", tokens),
                       path / SEQUENCES)
        with pytest.raises(InputError, match="request 'a': 3 response tokens but 2 rollout logprobs"):
            load_sequences(path)

    def test_vocab(self, tmp_path):
        """A token id the model does not have names the request and the vocabulary size."""
        seqs = load_sequences(write(tmp_path))
        check_vocab(seqs, 8)
        with pytest.raises(InputError, match=r"request 'b': token id 7 is outside the model's vocabulary \(0..6\)"):
            check_vocab(seqs, 7)

    def test_model_from_context(self, tmp_path):
        """Without --model the dump's context names the model; a folder without config.json is refused."""
        (tmp_path / "m").mkdir()
        meta = {"context": {"model": str(tmp_path / "m")}}
        with pytest.raises(InputError, match="not a local model directory"):
            resolve_model(meta, None)
        (tmp_path / "m" / "config.json").write_text("{}")
        assert resolve_model(meta, None) == tmp_path / "m"
        with pytest.raises(InputError, match="pass --model"):
            resolve_model({"context": {}}, None)


class TestTemperature:
    def test_sources(self):
        """The argument wins; else the dump's sampling temperature; raw logprobs are untempered; else 1.0."""
        meta = {"context": {"sampling": {"temperature": 0.7}}}
        assert resolve_temperature(meta, 0.9) == (0.9, "argument")
        assert resolve_temperature(meta, None) == (0.7, "dump")
        raw = {"context": {"sampling": {"temperature": 0.7, "logprobs_mode": "raw_logprobs"}}}
        assert resolve_temperature(raw, None)[0] == 1.0
        assert resolve_temperature({}, None) == (1.0, "default")
        with pytest.raises(InputError, match="temperature must be > 0"):
            resolve_temperature(meta, 0.0)
