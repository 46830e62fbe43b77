"""rlcheck.integrations.verl on plain tensors laid out as verl's batch (no verl import: see
tests/integration/test_verl.py for verl's own DataProto)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.stats import StatsConfig, compute_partial, finalize
from rlcheck.errors import ConfigError, InputError, MismatchHalt
from rlcheck.integrations import verl as V


def verl_fields(num_prompts: int = 3, n: int = 4, prompt_len: int = 6, response_len: int = 10, seed: int = 0):
    """(fields, rows): a mapping laid out as verl's step batch, and each row's unpadded truth.

    Prompts are left-padded, responses right-padded (rollout_log_probs with 0.0), every other row has a
    masked tool span, `uid` repeats each prompt's uuid for its n interleaved samples."""
    rng = np.random.default_rng(seed)
    b = num_prompts * n
    prompts = np.zeros((b, prompt_len), np.int64)
    attention = np.zeros((b, prompt_len + response_len), np.int64)
    responses = np.zeros((b, response_len), np.int64)
    mask = np.zeros((b, response_len), np.int64)
    rollout = np.zeros((b, response_len), np.float32)
    rows = []
    for i in range(b):
        p_len = 2 + (i // n) % (prompt_len - 1)
        r_len = int(rng.integers(3, response_len + 1))
        prompt = rng.integers(1, 100, p_len)
        prompts[i, prompt_len - p_len:] = prompt
        attention[i, prompt_len - p_len: prompt_len + r_len] = 1
        responses[i, :r_len] = rng.integers(1, 100, r_len)
        mask[i, :r_len] = 1
        if i % 2 and r_len > 4:
            mask[i, 1:3] = 0  # tool output inside the response
        rollout[i, :r_len] = -rng.exponential(1.0, r_len)
        rows.append({"prompt": prompt, "len": r_len})
    old = np.minimum(rollout + rng.normal(0, 1e-3, rollout.shape), 0).astype(np.float32)
    old[responses == 0] = -rng.exponential(1.0, int((responses == 0).sum()))  # actor's pad scores
    uids = np.array([f"uid-{i // n}" for i in range(b)], dtype=object)
    fields = {
        "prompts": torch.from_numpy(prompts), "attention_mask": torch.from_numpy(attention),
        "responses": torch.from_numpy(responses), "response_mask": torch.from_numpy(mask),
        "rollout_log_probs": torch.from_numpy(rollout), "old_log_probs": torch.from_numpy(old),
        "uid": uids, "priority": np.arange(b, dtype=np.int64),
    }
    return fields, rows


def packed_twin(fields) -> StepBatch:
    """The same data built by hand, row by row, with from_ragged."""
    resp_mask = fields["response_mask"].numpy().astype(bool)
    lens = [int(np.flatnonzero(m)[-1]) + 1 for m in resp_mask]  # the mask starts at column 0 here
    cut = lambda key: [fields[key].numpy()[i, :n] for i, n in enumerate(lens)]  # noqa: E731
    return StepBatch.from_ragged(cut("rollout_log_probs"), cut("old_log_probs"),
                                 V.default_request_ids(fields, len(lens)), cut("responses"),
                                 mask=[m[:n] for m, n in zip(resp_mask, lens, strict=True)])


def stats(batch: StepBatch) -> dict[str, float]:
    return finalize(compute_partial(batch, StatsConfig()))[0]


class TestToStepBatch:
    def test_rows_become_sequences(self):
        """Each row becomes one sequence of its response tokens, padding dropped, tool span kept masked."""
        fields, rows = verl_fields()
        batch = V.to_step_batch(fields)
        assert batch.num_sequences == len(rows)
        assert batch.seq_lens.tolist() == [r["len"] for r in rows]
        i = next(i for i, r in enumerate(rows) if i % 2 and r["len"] > 4)  # a row with a tool span
        seq = slice(batch.cu_seqlens[i], batch.cu_seqlens[i + 1])
        assert batch.mask[seq].tolist()[:4] == [True, False, False, True]
        np.testing.assert_array_equal(batch.tokens[seq], fields["responses"][i, : rows[i]["len"]].numpy())

    def test_same_statistics_as_packed(self):
        """The statistics equal those of the same rows packed by hand."""
        fields, _ = verl_fields()
        assert stats(V.to_step_batch(fields)) == stats(packed_twin(fields))

    def test_request_ids_add_the_sample_index(self):
        """n samples of one uid get '<uid>/0'..'<uid>/n-1', so every id is unique."""
        fields, _ = verl_fields(num_prompts=2, n=3)
        ids = V.to_step_batch(fields).request_ids
        assert ids == ("uid-0/0", "uid-0/1", "uid-0/2", "uid-1/0", "uid-1/1", "uid-1/2")

    def test_request_ids_after_reordering(self):
        """Rows reordered (verl's balance_batch) are numbered in their new order and stay unique."""
        fields, _ = verl_fields(num_prompts=2, n=3)
        fields["uid"] = fields["uid"][[3, 0, 4, 1, 5, 2]]
        assert V.to_step_batch(fields).request_ids == ("uid-1/0", "uid-0/0", "uid-1/1", "uid-0/1", "uid-1/2", "uid-0/2")

    def test_request_id_column_wins(self):
        """A complete non_tensor_batch['request_id'] column is used as is."""
        fields, rows = verl_fields()
        fields["request_id"] = np.array([f"vllm-{i}" for i in range(len(rows))], dtype=object)
        assert V.to_step_batch(fields).request_ids[:2] == ("vllm-0", "vllm-1")

    def test_incomplete_request_id_column_falls_back_to_uid(self):
        """A request_id column with a missing entry is ignored in favour of uid + sample index."""
        fields, _ = verl_fields()
        fields["request_id"] = np.array(["a", None] + ["b"] * 10, dtype=object)
        assert V.to_step_batch(fields).request_ids[0] == "uid-0/0"

    def test_explicit_request_ids(self):
        """request_ids= overrides whatever the batch holds."""
        fields, rows = verl_fields()
        ids = [f"r{i}" for i in range(len(rows))]
        assert V.to_step_batch(fields, request_ids=ids).request_ids == tuple(ids)

    def test_prompt_tokens_without_left_padding(self):
        """Prompt ids come out without verl's left padding."""
        fields, rows = verl_fields()
        batch = V.to_step_batch(fields)
        for got, row in zip(batch.prompt_tokens, rows, strict=True):
            np.testing.assert_array_equal(got, row["prompt"])

    def test_meta_carries_uid_and_priority(self):
        """uid and priority travel to the dump as per-sequence meta."""
        fields, rows = verl_fields()
        meta = V.to_step_batch(fields).meta
        assert meta["uid"][:2] == ["uid-0", "uid-0"] and meta["priority"] == list(range(len(rows)))

    def test_mask_from_attention_mask(self):
        """Without response_mask, the last R columns of attention_mask are used, as verl does."""
        fields, _ = verl_fields()
        del fields["response_mask"]
        batch = V.to_step_batch(fields)
        assert batch.mask.all()

    def test_logp_train_override(self):
        """logp_train= replaces old_log_probs (the hook that has old_log_prob before the union)."""
        fields, _ = verl_fields()
        other = fields.pop("old_log_probs") - 0.25
        batch = V.to_step_batch(fields, logp_train=other)
        assert np.allclose((batch.logp_train - batch.logp_rollout)[batch.mask], -0.25, atol=1e-2)

    def test_bf16_logprobs(self):
        """bf16 tensors (an actor in bf16) are read as float32."""
        fields, _ = verl_fields()
        fields["old_log_probs"] = fields["old_log_probs"].to(torch.bfloat16)
        assert V.to_step_batch(fields).logp_train.dtype == np.float32


class TestToStepBatchErrors:
    def test_missing_rollout_log_probs(self):
        """Without rollout_log_probs the error names the verl setting that stores them."""
        fields, _ = verl_fields()
        del fields["rollout_log_probs"]
        with pytest.raises(InputError, match=r"actor_rollout_ref\.rollout\.calculate_log_probs=True"):
            V.to_step_batch(fields)

    def test_missing_old_log_probs(self):
        """Without old_log_probs the error says where in verl's step to call."""
        fields, _ = verl_fields()
        del fields["old_log_probs"]
        with pytest.raises(InputError, match="old_log_probs"):
            V.to_step_batch(fields)

    def test_bypass_mode(self):
        """old_log_probs that is rollout_log_probs itself (bypass mode) is refused."""
        fields, _ = verl_fields()
        fields["old_log_probs"] = fields["rollout_log_probs"]
        with pytest.raises(InputError, match="bypass_mode"):
            V.to_step_batch(fields)

    def test_bypass_mode_value_equal_copy(self, tmp_path):
        """v1 bypass mode: old_log_probs a value-equal copy in another buffer is refused by observe given
        verl's config (bitwise-equal sides alone read as a true on-policy engine's: observed, one note)."""
        fields, _ = verl_fields()
        fields["old_log_probs"] = fields["rollout_log_probs"].clone()
        assert fields["old_log_probs"].data_ptr() != fields["rollout_log_probs"].data_ptr()
        mon = Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",)))
        bypass = {"algorithm": {"rollout_correction": {"bypass_mode": True}}}
        with pytest.raises(ConfigError, match="bypass_mode"):
            V.observe(mon, 0, fields, config=bypass)
        with pytest.warns(UserWarning, match="agree bitwise"):
            assert V.observe(mon, 0, fields, config={"algorithm": {}}).alarms == []

    def test_shape_mismatch(self):
        """A field of another shape names itself and the expected layout."""
        fields, _ = verl_fields()
        fields["old_log_probs"] = fields["old_log_probs"][:, :-1]
        with pytest.raises(InputError, match=r"old_log_probs has shape .*response_length"):
            V.to_step_batch(fields)

    def test_not_two_dimensional(self):
        """Flat logprobs are refused with the expected layout."""
        fields, _ = verl_fields()
        fields["rollout_log_probs"] = fields["rollout_log_probs"].reshape(-1)
        with pytest.raises(InputError, match=r"\[batch, response_length\]"):
            V.to_step_batch(fields)

    def test_no_ids(self):
        """Without uid or request_id the rows cannot be named."""
        fields, _ = verl_fields()
        del fields["uid"]
        with pytest.raises(InputError, match="uid"):
            V.to_step_batch(fields)

    def test_not_a_batch(self):
        """Something that is neither a DataProto nor a mapping is refused."""
        with pytest.raises(InputError, match="DataProto"):
            V.to_step_batch([1, 2, 3])


class TestForwardedMetrics:
    def test_prefixes_select(self):
        """Only verl's mismatch metrics and entropy are forwarded by default."""
        got = V.forwarded_metrics({"training/rollout_probs_diff_mean": 0.1, "rollout_corr/kl": np.float32(0.5),
                                   "actor/entropy": torch.tensor(1.5), "critic/score/mean": 1.0})
        assert got == {"training/rollout_probs_diff_mean": 0.1, "rollout_corr/kl": 0.5, "actor/entropy": 1.5}

    def test_non_numbers_and_nan_dropped(self):
        """Lists, strings, NaN and rlcheck's own keys are not forwarded."""
        got = V.forwarded_metrics({"a": [1, 2], "b": "x", "c": float("nan"), "rlcheck/x": 1.0, "d": 2}, None)
        assert got == {"d": 2.0}

    def test_empty_prefixes_forward_nothing(self):
        """forward=() forwards nothing."""
        assert V.forwarded_metrics({"training/rollout_probs_diff_mean": 0.1}, ()) == {}


class TestObserve:
    def test_logs_rlcheck_and_verl_metrics(self, tmp_path):
        """observe logs rlcheck's metrics and verl's forwarded ones on the same JSONL line."""
        fields, _ = verl_fields()
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            report = V.observe(mon, 3, fields, {"training/rollout_probs_diff_mean": 0.01, "perf/x": 1.0})
        line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
        assert line["step"] == 3 and not report.halted
        assert line["metrics"]["training/rollout_probs_diff_mean"] == 0.01 and "perf/x" not in line["metrics"]
        assert line["metrics"][K.TOKEN_COUNT] == report.metrics[K.TOKEN_COUNT]


    def test_precision_from_verl_config(self):
        """`precision(config)` reads both sides' dtypes from verl's config (its bfloat16 defaults where
        unset); a dtype rlcheck does not know leaves the pair to calibrate."""
        cfg = {"actor_rollout_ref": {"rollout": {"dtype": "float32"}, "actor": {"fsdp_config": {"dtype": "fp32"}}}}
        assert (V.precision(cfg).engine, V.precision(cfg).trainer, V.precision(cfg).level) == ("float32", "float32", 1e-5)
        assert V.precision({}).level == 1e-2
        assert V.precision({"actor_rollout_ref": {"rollout": {"dtype": "fp8"}}}).level is None


class TestWeightVersions:
    """verl's fully async trainer records each trajectory's first weights version (min_global_steps)."""

    def _with_versions(self, versions):
        fields, _ = verl_fields()
        return {**fields, "min_global_steps": np.array(versions, dtype=object)}

    def test_versions_become_weight_version(self):
        fields = self._with_versions([5] * 6 + [4] * 6)
        assert V.to_step_batch(fields).weight_version.tolist() == [5] * 6 + [4] * 6
        assert V.to_step_batch(verl_fields()[0]).weight_version is None
        assert V.to_step_batch(self._with_versions([None] * 12)).weight_version is None

    def test_a_lag_past_the_allowed_one_halts(self, tmp_path):
        fields = self._with_versions([5] * 6 + [3] * 6)
        with Monitor(MonitorConfig(run_dir=tmp_path / "async", sinks=("jsonl",), max_weight_lag=2)) as mon:
            assert not V.observe(mon, 0, fields, trainer_version=5).alarms  # within the staleness allowed
        with Monitor(MonitorConfig(run_dir=tmp_path / "on-policy", sinks=("jsonl",))) as mon:
            with pytest.raises(MismatchHalt) as halted:
                V.observe(mon, 0, fields, trainer_version=5)
        (alarm,) = [a for a in halted.value.report.alarms if a.kind == "weights"]
        assert alarm.details["max_lag"] == 2 and alarm.details["stale"] == 6

    def test_global_steps_convention(self, tmp_path):
        """Legacy/v1: step G's rows ran on the weights synced at the end of step G-1 (min_global_steps
        G-1); passing verl's own global_steps raises nothing over a healthy run, a missed sync halts."""
        with Monitor(MonitorConfig(run_dir=tmp_path / "healthy", sinks=("jsonl",))) as mon:
            for g in (1, 2, 3, 4):  # verl's global_steps start at 1
                assert not V.observe(mon, g, self._with_versions([g - 1] * 12), global_steps=g).alarms
        with Monitor(MonitorConfig(run_dir=tmp_path / "missed", sinks=("jsonl",))) as mon:
            V.observe(mon, 1, self._with_versions([0] * 12), global_steps=1)
            with pytest.raises(MismatchHalt):  # the sync at the end of step 1 did not happen
                V.observe(mon, 2, self._with_versions([0] * 12), global_steps=2)

    def test_global_steps_and_trainer_version_conflict(self, tmp_path):
        """Both given is a ConfigError: global_steps is the one to pass."""
        with Monitor(MonitorConfig(run_dir=tmp_path / "r", sinks=("jsonl",))) as mon:
            with pytest.raises(ConfigError, match="global_steps"):
                V.observe(mon, 1, self._with_versions([0] * 12), global_steps=1, trainer_version=1)

    def test_bad_versions(self):
        with pytest.raises(InputError, match="min_global_steps"):
            V.to_step_batch(self._with_versions([1] * 5))
        with pytest.raises(InputError, match="integer"):
            V.to_step_batch(self._with_versions(["x"] * 12))


class TestVerlEquivalents:
    def test_keys_are_rlcheck_metrics(self):
        """Every equivalent names a metric rlcheck always logs, with sign +1 or -1."""
        for rl_key, sign in V.VERL_EQUIVALENTS.values():
            assert rl_key in K.ALWAYS and sign in (1.0, -1.0)


class TestHandBack:
    """observe hands the quarantine and the correction back to verl's batch, as verl's own
    compute_rollout_correction_and_add_to_batch does (response_mask, rollout_is_weights)."""

    BAD = 3

    def _corrupted(self, bad=(BAD,)):
        fields, _ = verl_fields()
        rollout, mask = fields["rollout_log_probs"], fields["response_mask"]
        rollout[list(bad)] = torch.where(mask[list(bad)].bool(), -25.0, rollout[list(bad)])
        return fields, mask.clone()

    def _observe(self, tmp_path, fields, quarantine=QuarantineConfig(), **kw):
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=(), quarantine=quarantine)) as mon:
            return V.observe(mon, 0, fields, **kw)

    def test_quarantined_row_leaves_response_mask(self, tmp_path):
        """The quarantined row's response_mask is all 0, the other rows' unchanged, dtype kept."""
        fields, before = self._corrupted()
        report = self._observe(tmp_path, fields)
        assert [q.index for q in report.quarantined] == [self.BAD]
        after = fields["response_mask"]
        assert after.dtype == before.dtype and not after[self.BAD].any()
        rest = [i for i in range(len(before)) if i != self.BAD]
        assert torch.equal(after[rest], before[rest]) and V.WEIGHTS_KEY not in fields

    def test_nothing_written_without_quarantine_or_correction(self, tmp_path):
        """Quarantine off and no correction: the batch is left as it was (the same mask tensor)."""
        fields, _ = verl_fields()
        mask = fields["response_mask"]
        self._observe(tmp_path, fields, quarantine=None)
        assert fields["response_mask"] is mask and V.WEIGHTS_KEY not in fields

    def test_correction_weights_are_the_reports(self, tmp_path):
        """rollout_is_weights is report.token_weights() laid out [B, R]: old_log_probs' dtype, 0 on
        padding and on the quarantined row."""
        fields, before = self._corrupted()
        cfg = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
        report = self._observe(tmp_path, fields, correction=cfg)
        w = fields[V.WEIGHTS_KEY]
        assert w.shape == before.shape and w.dtype == fields["old_log_probs"].dtype
        assert not w[before == 0].any() and not w[self.BAD].any()
        packed = report.token_weights(**{k: getattr(cfg, k) for k in ("rollout_is", "rollout_is_threshold")})
        np.testing.assert_array_equal(w[before.bool()].numpy(), packed[report.batch.mask])

    def test_rejection_folds_into_response_mask(self, tmp_path):
        """A sequence-level rejection zeroes the rejected rows' response_mask; without rollout_is no
        weights are written (as verl)."""
        fields, before = self._corrupted()
        fields["old_log_probs"][:6] += -0.2 * fields["response_mask"][:6]  # rows 0-5 drift off
        cfg = CorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)
        report = self._observe(tmp_path, fields, correction=cfg)
        kept = fields["response_mask"].bool().any(axis=1).tolist()
        assert kept == [False] * 6 + [True] * (len(before) - 6) and V.WEIGHTS_KEY not in fields
        assert report.correction(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01).metrics[
            "rollout_rs_seq_masked_fraction"] == pytest.approx(5 / 11)  # rows 0-5 but the quarantined 3, of the 11 kept

    def test_bf16_weights(self, tmp_path):
        """Weights take old_log_probs' dtype (bf16 here), as verl's helper returns them."""
        fields, _ = self._corrupted()
        fields["old_log_probs"] = fields["old_log_probs"].to(torch.bfloat16)
        self._observe(tmp_path, fields, correction=CorrectionConfig(rollout_is="sequence"))
        assert fields[V.WEIGHTS_KEY].dtype == torch.bfloat16

    def test_numpy_fields(self, tmp_path):
        """A mapping of numpy arrays gets numpy arrays back."""
        fields, _ = self._corrupted()
        fields = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        self._observe(tmp_path, fields, correction=CorrectionConfig(rollout_is="token"))
        assert fields[V.MASK_KEY].dtype == np.int64 and fields[V.WEIGHTS_KEY].dtype == np.float32
        assert not fields[V.MASK_KEY][self.BAD].any()

    def test_halt_leaves_the_batch(self, tmp_path):
        """Past max_frac the run halts and the batch is not touched."""
        fields, before = self._corrupted(bad=(1, 3, 5))
        with pytest.raises(MismatchHalt):
            self._observe(tmp_path, fields, correction=CorrectionConfig(rollout_is="token"))
        assert torch.equal(fields["response_mask"], before) and V.WEIGHTS_KEY not in fields

    def test_bad_correction(self, tmp_path):
        """correction= takes a CorrectionConfig."""
        fields, _ = self._corrupted()
        with pytest.raises(ConfigError, match="CorrectionConfig"):
            self._observe(tmp_path, fields, correction="token")

    def test_another_batch_refused(self, tmp_path):
        """update_batch on a batch of other rows than the report's says so."""
        fields, _ = self._corrupted()
        report = self._observe(tmp_path, fields)
        other, _ = verl_fields(num_prompts=2)
        with pytest.raises(InputError, match="the batch the report observed"):
            V.update_batch(other, report)
