"""rlcheck.integrations.verl on verl's own DataProto, filled the way verl 0.9's legacy RayPPOTrainer.fit
fills it (uid per prompt, repeat(n, interleave=True), union with the agent loop's padded output, union
with old_log_probs, reorder by balance_batch), and checked against verl's own mismatch metrics.

Needs verl (imported without its heavy deps):
    pip install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0
"""

from __future__ import annotations

import copy
import math
import uuid

import numpy as np
import pytest
import torch

from rlcheck.core import metrics as K
from rlcheck.core.batch import StepBatch
from rlcheck.core.correction import CorrectionConfig
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.quarantine import QuarantineConfig
from rlcheck.core.run.dump import read_dump
from rlcheck.errors import ConfigError, InputError, MismatchHalt
from rlcheck.integrations import verl as V

pytestmark = pytest.mark.slow
verl = pytest.importorskip("verl", reason="pip install --no-deps verl==0.9.1 (see the module docstring)")
from verl import DataProto  # noqa: E402
from verl.utils.torch_functional import pad_2d_list_to_length, pad_sequence_to_length  # noqa: E402

PROMPT_LEN, RESPONSE_LEN = 8, 12
F32_MEAN_TOL = 16 * float(np.finfo(np.float32).eps)
"""How far apart two float32 means of terms near 1 may land under different summation orders (a CPU's
vector width, the batch's row order): verl reduces in float32, rlcheck in float64. Measured: 2.2e-7 over
600 row orders of this batch, where a tolerance of 1e-4 relative and 1e-7 absolute failed 3."""


def agent_loop_output(samples: list[dict]) -> DataProto:
    """The agent loop's batch: prompts left-padded, responses, masks and rollout logprobs right-padded
    with zeros, response_mask = mask x response attention (verl's `_agent_loop_postprocess`)."""
    prompts = torch.cat([pad_sequence_to_length(torch.tensor([s["prompt"]]), PROMPT_LEN, 0, left_pad=True)
                         for s in samples])
    prompt_attn = torch.cat([pad_sequence_to_length(torch.ones(1, len(s["prompt"]), dtype=torch.int64),
                                                    PROMPT_LEN, 0, left_pad=True) for s in samples])
    responses = pad_2d_list_to_length([s["response"] for s in samples], 0, RESPONSE_LEN)
    resp_attn = pad_2d_list_to_length([[1] * len(s["response"]) for s in samples], 0, RESPONSE_LEN)
    mask = pad_2d_list_to_length([s["mask"] for s in samples], 0, RESPONSE_LEN) * resp_attn
    rollout = pad_2d_list_to_length([s["logp_rollout"] for s in samples], 0.0, RESPONSE_LEN).float()
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": mask,
                 "input_ids": torch.cat([prompts, responses], 1), "rollout_log_probs": rollout,
                 "attention_mask": torch.cat([prompt_attn, resp_attn], 1)},
        non_tensors={"priority": np.arange(len(samples), dtype=np.int64)},
    )


def verl_step(num_prompts: int = 4, n: int = 3, seed: int = 0, noise: float = 1e-3) -> tuple[DataProto, list[dict]]:
    """(batch, samples): one step's batch as the driver holds it after old_log_probs, and each row's truth."""
    rng = np.random.default_rng(seed)
    batch = DataProto.from_single_dict({"dummy_tensor": torch.zeros(num_prompts, 1, dtype=torch.uint8),
                                        "data_source": np.array(["toy"] * num_prompts, dtype=object)})
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(num_prompts)], dtype=object)
    prompts = [rng.integers(1, 100, rng.integers(2, PROMPT_LEN + 1)).tolist() for _ in range(num_prompts)]
    batch = batch.repeat(repeat_times=n, interleave=True)
    samples = []
    for i in range(num_prompts * n):
        r_len = int(rng.integers(3, RESPONSE_LEN + 1))
        mask = [1] * r_len
        logp = (-rng.exponential(1.0, r_len)).tolist()
        if i % 3 == 1 and r_len > 5:  # a tool call: its output is masked and has no sampling logprob
            mask[2:4], logp[2:4] = [0, 0], [0.0, 0.0]
        samples.append({"prompt": prompts[i // n], "response": rng.integers(1, 100, r_len).tolist(),
                        "mask": mask, "logp_rollout": logp, "uid": batch.non_tensor_batch["uid"][i]})
    batch = batch.union(agent_loop_output(samples))
    rollout = batch.batch["rollout_log_probs"]
    draw = torch.randn(rollout.shape, generator=torch.Generator().manual_seed(seed))
    old = torch.where(batch.batch["response_mask"].bool(), rollout + noise * draw, -3.0)
    batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": old.clamp(max=0.0)}))
    perm = rng.permutation(len(samples))  # balance_batch reorders the rows
    batch.reorder(torch.from_numpy(perm))
    samples = [samples[i] for i in perm]
    for s, t in zip(samples, batch.batch["old_log_probs"], strict=True):
        s["logp_train"] = t[: len(s["response"])].tolist()
    return batch, samples


def packed_twin(samples: list[dict]) -> StepBatch:
    """The same rows packed by hand from the unpadded truth, numbered '<uid>/<k>' in batch order."""
    seen: dict[str, int] = {}
    ids = []
    for s in samples:
        ids.append(f"{s['uid']}/{seen.setdefault(s['uid'], 0)}")
        seen[s["uid"]] += 1
    col = lambda key, dtype: [np.asarray(s[key], dtype) for s in samples]  # noqa: E731
    return StepBatch.from_ragged(col("logp_rollout", np.float32), col("logp_train", np.float32), ids,
                                 col("response", np.int64), mask=col("mask", bool))


def without_timing(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != K.MONITOR_SECONDS}


class TestVerlDataProto:
    def test_metrics_equal_packed(self, tmp_path):
        """A Monitor fed verl's DataProto logs what one fed the same rows packed by hand logs."""
        batch, samples = verl_step()
        cfg = lambda d: MonitorConfig(run_dir=tmp_path / d, sinks=("jsonl",))  # noqa: E731
        with Monitor(cfg("verl")) as a, Monitor(cfg("packed")) as b:
            got, want = V.observe(a, 1, batch), b.observe(1, packed_twin(samples))
        assert without_timing(got.metrics) == without_timing(want.metrics)
        assert [o.to_dict() for o in got.offenders] == [o.to_dict() for o in want.offenders]

    def test_request_ids_name_uid_and_sample(self):
        """Ids are unique, one per row, and carry the row's uid."""
        batch, samples = verl_step()
        ids = V.to_step_batch(batch).request_ids
        assert len(set(ids)) == len(samples)
        assert all(rid.rsplit("/", 1)[0] == s["uid"] for rid, s in zip(ids, samples, strict=True))

    @pytest.mark.parametrize("seed", [0, 11])  # 11: a row order whose float32 chi2 lands 1.6e-7 off
    def test_verl_own_metrics_match(self, tmp_path, seed):
        """verl's calculate_debug_metrics and compute_offpolicy_metrics equal rlcheck's as VERL_EQUIVALENTS says,
        in the batch's row order and in others (verl's float32 sums round differently in each)."""
        from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
        from verl.utils.debug.metrics import calculate_debug_metrics

        batch, _ = verl_step(seed=seed, noise=0.05)
        orders = [torch.arange(len(batch))] + [torch.randperm(len(batch), generator=torch.Generator().manual_seed(k))
                                                for k in range(8)]
        for i, order in enumerate(orders):
            b = batch.batch[order]
            theirs = calculate_debug_metrics(batch[order])
            theirs |= {f"rollout_corr/{k}": v for k, v in compute_offpolicy_metrics(
                b["old_log_probs"], b["rollout_log_probs"], b["response_mask"]).items()}
            with Monitor(MonitorConfig(run_dir=tmp_path / str(i), sinks=("jsonl",))) as mon:
                ours = V.observe(mon, 1, batch, theirs).metrics
            for verl_key, (key, sign) in V.VERL_EQUIVALENTS.items():
                assert math.isclose(theirs[verl_key], sign * ours[key], rel_tol=1e-4, abs_tol=F32_MEAN_TOL), verl_key
                assert ours[verl_key] == pytest.approx(theirs[verl_key])  # forwarded beside rlcheck's

    def test_corrupted_rows_halt_with_dump(self, tmp_path):
        """Rollout logprobs corrupted on two rows halt the run; offenders and dump name those rows."""
        batch, samples = verl_step()
        bad = [2, 7]
        rollout = batch.batch["rollout_log_probs"]
        rollout[bad] = torch.where(batch.batch["response_mask"][bad].bool(), -25.0, rollout[bad])
        want = {V.to_step_batch(batch).request_ids[i] for i in bad}
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon, pytest.raises(MismatchHalt) as exc:
            V.observe(mon, 5, batch)
        assert {o.request_id for o in exc.value.report.offenders[:2]} == want
        rows, meta = read_dump(exc.value.dump_dir)
        assert {r["request_id"] for r in rows if r["max_abs_diff"] > 10} == want
        assert meta["step"] == 5 and {r["uid"] for r in rows} == {s["uid"] for s in samples}
        by_id = {r["request_id"]: r for r in rows}
        for rid, s in zip(V.to_step_batch(batch).request_ids, samples, strict=True):
            assert list(by_id[rid]["prompt_tokens"]) == list(s["prompt"]) and list(by_id[rid]["response_tokens"]) == list(s["response"])

    def test_async_weight_versions_halt_past_the_allowed_lag(self, tmp_path):
        """A real DataProto carrying verl's per-trajectory `min_global_steps` (as its fully async
        trainer assembles them): rows two versions behind pass with max_weight_lag=2 and halt the
        on-policy default at once, the weights alarm naming them; the dump keeps their versions."""
        batch, _ = verl_step()
        rows = len(batch)
        batch.non_tensor_batch["min_global_steps"] = np.array([7] * (rows - 3) + [5] * 3, dtype=object)
        with Monitor(MonitorConfig(run_dir=tmp_path / "lag2", sinks=("jsonl",), max_weight_lag=2)) as mon:
            assert not V.observe(mon, 1, batch, trainer_version=7).alarms
        with Monitor(MonitorConfig(run_dir=tmp_path / "lag0", sinks=("jsonl",))) as mon, pytest.raises(MismatchHalt) as exc:
            V.observe(mon, 1, batch, trainer_version=7)
        (alarm,) = [a for a in exc.value.report.alarms if a.kind == "weights"]
        ids = V.to_step_batch(batch).request_ids
        assert alarm.details["stale"] == 3 and set(alarm.details["request_ids"]) == set(ids[-3:])
        dumped, _ = read_dump(exc.value.dump_dir)
        assert sorted(r["weight_version"] for r in dumped) == [5] * 3 + [7] * (rows - 3)

    @pytest.mark.supports("verl", "trainer", "fully async, partial rollouts", status=(
        "tested here on real DataProtos shaped as the fully async trainer assembles them, and in verl's real "
        "fully async trainer on CPU (test_verl_trainer.py, quiet with its lagged rows): rows on the trainer's "
        "version compared, lagged rows left out, a lag past verl's settings halts"))
    def test_fully_async_compares_the_current_version_and_bounds_the_lag(self, tmp_path):
        """The fully async trainer at current_param_version 5, staleness_threshold 0.5 with partial
        rollouts (rows may lag ceil(0.5) + 1 = 2 versions): half the rows generated on version 5, a
        quarter resumed across the last sync (min 4, max 5), a quarter on version 3, the lagged ones
        0.3-0.5 nats off (the policy moved, by design). The lagged rows are left out of the statistics
        and counted, nothing alarms; a row 3 versions behind halts on the weights alarm. Before,
        trainer_version=5 at max_weight_lag 0 halted the healthy step."""
        def step(seed: int, oldest: int) -> DataProto:
            batch, _ = verl_step(seed=seed)
            rows, q = len(batch), len(batch) // 4
            first = np.array([5] * (rows - 2 * q) + [4] * q + [oldest] * q, dtype=object)
            last = np.array([5] * (rows - q) + [oldest] * q, dtype=object)
            batch.non_tensor_batch["min_global_steps"], batch.non_tensor_batch["max_global_steps"] = first, last
            lag = torch.tensor([0.0] * (rows - 2 * q) + [0.3] * q + [0.5] * q)[:, None]  # (B, 1)
            batch.batch["old_log_probs"] = batch.batch["old_log_probs"] - lag * batch.batch["response_mask"]
            return batch

        async_training = {"staleness_threshold": 0.5, "partial_rollout": True, "trigger_parameter_sync_step": 4}
        with Monitor(MonitorConfig(run_dir=tmp_path / "async", sinks=("jsonl",))) as mon:
            report = V.observe(mon, 1, step(1, 3), param_version=5, async_training=async_training)
            assert report.alarms == [] and report.metrics["verl_async/lagged_frac"] == 0.5
            assert report.metrics[K.ABS_DIFF_MAX] < 0.05 and report.metrics["verl_async/max_lag"] == 2
            with pytest.raises(MismatchHalt) as halted:
                V.observe(mon, 2, step(2, 2), param_version=5, async_training=async_training)
        (alarm,) = [a for a in halted.value.report.alarms if a.kind == "weights"]
        assert alarm.severity == "critical" and "allowed lag 2" in alarm.message
        with Monitor(MonitorConfig(run_dir=tmp_path / "before", sinks=("jsonl",))) as mon, pytest.raises(MismatchHalt):
            V.observe(mon, 1, step(1, 3), trainer_version=5)
        with pytest.raises(ConfigError, match="param_version"):
            V.observe(None, 1, step(1, 3), param_version=5, trainer_version=5, async_training=async_training)

    def test_bypass_mode_refused(self):
        """verl's bypass mode (old_log_probs = rollout_log_probs) is refused: nothing was recomputed."""
        batch, _ = verl_step()
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        with pytest.raises(InputError, match="bypass_mode"):
            V.to_step_batch(batch)

    @pytest.mark.supports("verl", "trainer", "bypass mode",
                          status="refused: ConfigError before verl starts its workers (the plugin), at attach (preflight) and in observe(config=), bypass_mode")
    def test_bypass_mode_value_equal_copy(self, tmp_path):
        """v1 bypass mode through the transfer queue: old_log_probs a value-equal copy (another buffer) of
        rollout_log_probs is refused from verl's config, at attach (the preflight) and in observe(config=),
        never "abs_diff_max 0, healthy"."""
        batch, _ = verl_step()
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
        config = {"algorithm": {"rollout_correction": {"bypass_mode": True}}}
        with pytest.raises(ConfigError, match="bypass_mode"):
            V.preflight(config)
        with Monitor(MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",))) as mon:
            with pytest.raises(ConfigError, match="bypass_mode"):
                V.observe(mon, 1, batch, config=config)

    @pytest.mark.supports("verl", "trainer", "legacy RayPPOTrainer", "v1")
    def test_global_steps_convention(self, tmp_path):
        """Legacy RayPPOTrainer / v1: step G's rows carry min_global_steps G-1 (update_weights(G) at the end
        of step G); verl's own global_steps over a healthy run raises nothing, a missed sync halts."""
        def step(g: int, version: int) -> DataProto:
            batch, _ = verl_step(seed=g)
            batch.non_tensor_batch["min_global_steps"] = np.array([version] * len(batch), dtype=object)
            return batch

        with Monitor(MonitorConfig(run_dir=tmp_path / "healthy", sinks=("jsonl",))) as mon:
            for g in range(1, 5):
                assert not V.observe(mon, g, step(g, g - 1), global_steps=g).alarms
        with Monitor(MonitorConfig(run_dir=tmp_path / "missed", sinks=("jsonl",))) as mon:
            V.observe(mon, 1, step(1, 0), global_steps=1)
            with pytest.raises(MismatchHalt) as halted:  # the sync at the end of step 1 did not happen
                V.observe(mon, 2, step(2, 0), global_steps=2)
        assert [a.kind for a in halted.value.report.alarms if a.kind == "weights"] == ["weights"]

    def test_missing_rollout_log_probs(self):
        """A batch without rollout_log_probs names the verl setting that stores them."""
        batch, _ = verl_step()
        batch.pop(batch_keys=["rollout_log_probs"])
        with pytest.raises(InputError, match="calculate_log_probs=True"):
            V.to_step_batch(batch)


class TestHandBack:
    """observe writes the quarantine and the correction into verl's DataProto as verl's own
    compute_rollout_correction_and_add_to_batch writes its correction."""

    BAD = 4

    def _step(self):
        """verl_step's batch with a seeded mismatch whose scale varies by row (0.02 / 0.1 / 0.3, so a
        k3 rejection keeps some rows), two tokens past the TIS bounds, and row BAD corrupted."""
        batch, _ = verl_step()
        b, rng = batch.batch, np.random.default_rng(1)
        mask, rollout = b["response_mask"].bool(), b["rollout_log_probs"]
        rollout[[1, 2], 0] = -2.0
        scale = torch.tensor([0.02, 0.1, 0.3])[torch.arange(len(batch)) % 3, None]
        d = torch.from_numpy(rng.normal(0.0, 1.0, tuple(rollout.shape))).float() * scale
        d[[1, 2], 0] = torch.tensor([1.2, -1.2])
        b["old_log_probs"] = torch.where(mask, (rollout + d).clamp(max=0.0), -3.0)
        rollout[self.BAD] = torch.where(mask[self.BAD], -25.0, rollout[self.BAD])
        return batch

    def _observe(self, tmp_path, batch, correction=None):
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=(), quarantine=QuarantineConfig())
        with Monitor(cfg) as mon:
            return V.observe(mon, 1, batch, correction=correction)

    def _verl(self, batch, **cfg):
        """verl's correction of the same DataProto with the corrupted row masked by hand."""
        return self._verl_masked(batch, [self.BAD], **cfg)

    @staticmethod
    def _verl_masked(batch, rows, **cfg):
        """verl's correction of a copy of `batch` with `rows` masked by hand."""
        from verl.trainer.config.algorithm import RolloutCorrectionConfig
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

        twin = copy.deepcopy(batch)
        twin.batch["response_mask"][rows] = 0
        twin, _ = compute_rollout_correction_and_add_to_batch(twin, RolloutCorrectionConfig(**cfg))
        return twin.batch

    def test_quarantined_row_masked(self, tmp_path):
        """The corrupted row is quarantined: its response_mask is 0, every other row's unchanged."""
        batch = self._step()
        before = batch.batch["response_mask"].clone()
        report = self._observe(tmp_path, batch)
        assert [q.index for q in report.quarantined] == [self.BAD]
        after = batch.batch["response_mask"]
        rest = [i for i in range(len(batch)) if i != self.BAD]
        assert not after[self.BAD].any() and torch.equal(after[rest], before[rest]) and after.dtype == before.dtype

    @pytest.mark.parametrize("cfg", [
        dict(rollout_is="token", rollout_is_threshold=2.0),
        dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    ])
    def test_correction_equals_verl(self, tmp_path, cfg):
        """rollout_is_weights and response_mask equal verl's own on the batch with that row masked
        (rlcheck's weights are 0 where its mask is, verl's stay: equal on the mask)."""
        batch = self._step()
        want = self._verl(batch, **cfg)
        assert batch.batch["response_mask"][self.BAD].any()  # verl got a copy
        self._observe(tmp_path, batch, correction=CorrectionConfig(**cfg))
        got = batch.batch
        assert torch.equal(got["response_mask"], want["response_mask"])
        assert got["rollout_is_weights"].dtype == want["rollout_is_weights"].dtype
        torch.testing.assert_close(got["rollout_is_weights"], want["rollout_is_weights"] * want["response_mask"],
                                   rtol=1e-5, atol=1e-6)
        assert not got["rollout_is_weights"][self.BAD].any()
        if "rollout_rs" in cfg:  # some rows rejected, some kept
            assert 1 < want["response_mask"].bool().any(axis=1).sum() < len(batch) - 1

    def test_verl_rejection_runs_after(self, tmp_path):
        """verl's own correction, rollout_is off, afterwards: no weights clash, the quarantine stays."""
        from verl.trainer.config.algorithm import RolloutCorrectionConfig
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

        batch = self._step()
        self._observe(tmp_path, batch, correction=CorrectionConfig(rollout_is="token"))
        weights = batch.batch["rollout_is_weights"].clone()
        batch, _ = compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(rollout_is=None))
        assert not batch.batch["response_mask"][self.BAD].any() and torch.equal(batch.batch["rollout_is_weights"], weights)

    @pytest.mark.parametrize("correction", [None, CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)])
    def test_fully_async_hand_back(self, tmp_path, correction):
        """The fully async trainer with quarantine (and correction): 40 rows, 4 generated on the previous
        version (left out of the statistics), 1 corrupt. The corrupt row leaves response_mask; the lagged
        rows still train, and with correction get verl's own weights (the IS ratio is what corrects an
        off-policy row). Before, the hand-back counted the lagged rows' hidden tokens as missing and
        raised InputError after the step was journaled."""
        batch, _ = verl_step(num_prompts=10, n=4, seed=3)
        rows, lagged, bad = len(batch), [5, 17, 22, 31], 12
        first = np.array([5] * rows, dtype=object)
        first[lagged] = 4
        batch.non_tensor_batch["min_global_steps"] = first
        batch.non_tensor_batch["max_global_steps"] = first.copy()
        b = batch.batch
        b["old_log_probs"][lagged] -= 0.3 * b["response_mask"][lagged]  # the policy moved by one version
        b["rollout_log_probs"][bad] = torch.where(b["response_mask"][bad].bool(), -25.0, b["rollout_log_probs"][bad])
        before = b["response_mask"].clone()
        want = None
        if correction is not None:
            want = self._verl_masked(batch, [bad], rollout_is="token", rollout_is_threshold=2.0)
        cfg = MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",), quarantine=QuarantineConfig())
        with Monitor(cfg) as mon:
            report = V.observe(mon, 1, batch, param_version=5, correction=correction,
                               async_training={"staleness_threshold": 0.5, "partial_rollout": True})
        assert [q.index for q in report.quarantined] == [bad] and report.metrics["verl_async/lagged_frac"] == pytest.approx(0.1)
        after = b["response_mask"]
        rest = [i for i in range(rows) if i != bad]
        assert not after[bad].any() and torch.equal(after[rest], before[rest])
        if correction is not None:
            torch.testing.assert_close(b["rollout_is_weights"], want["rollout_is_weights"] * want["response_mask"],
                                       rtol=1e-5, atol=1e-6)
            assert b["rollout_is_weights"][lagged].lt(1.0).any()  # the lagged rows are weighted, not skipped
