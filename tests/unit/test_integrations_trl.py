"""The TRL integration's pure logic: TRL's padded step tensors to a StepBatch, request ids and row meta,
TRL's scalars, the options, the sampling settings and faults it accepts, the weight-sync wrapper,
quarantined rows leaving TRL's loss mask (the hook on a stand-in trainer, a real Monitor), and vLLM's
top-k lists split for TRL and rlcheck, lined up with the trainer's extra forward."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from rlcheck.errors import ConfigError, InputError
from rlcheck.faults import parse_inject
from rlcheck.integrations.trl import TRLOptions
from rlcheck.integrations.trl.batch import (
    mask_rows,
    new_scalars,
    quarantined_rows,
    request_ids,
    row_meta,
    to_step_batch,
)
from rlcheck.integrations.trl.config import check_fault as _fault
from rlcheck.integrations.trl.config import check_sampling, logit_processing, trl_context
from rlcheck.integrations.trl.sync import WeightSync, resolve_method
from rlcheck.integrations.trl.topk import (
    DEFAULT_TOP_K,
    EngineTopK,
    check_topk,
    padded_engine_topk,
    resolve_top_k,
    split_sampled,
    step_topk,
)


def trl_output(tool: bool = False, truncated_row: int | None = None) -> dict:
    """A TRL step output of 3 rows as `_generate_and_score_completions` returns it: left-padded prompts,
    right-padded completions of lengths 4, 2 and 3 (padding logprob 0.0, one NaN from vLLM)."""
    lens = [4, 2, 3]
    c = max(lens)
    cm = torch.tensor([[1] * n + [0] * (c - n) for n in lens])  # (B, C)
    sampling = -torch.arange(1, 13, dtype=torch.float32).reshape(3, 4) / 10 * cm  # (B, C)
    sampling[2, 1] = float("nan")
    out = {
        "prompt_ids": torch.tensor([[2, 5, 6], [7, 8, 9], [2, 2, 4]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]),
        "completion_ids": torch.arange(100, 112).reshape(3, 4) * cm,
        "completion_mask": cm,
        "sampling_per_token_logps": sampling,
        "old_per_token_logps": sampling - 0.01,
    }
    if tool:
        out["tool_mask"] = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    if truncated_row is not None:
        out["completion_mask"] = cm.clone()
        out["completion_mask"][truncated_row] = 0
    return out


class TestRequestIds:
    def test_unique_across_steps_ranks_and_rows(self):
        """Ids name step, rank and row, so no two rows of a run share one."""
        ids = [i for s in range(3) for r in range(2) for i in request_ids(s, r, 4)]
        assert len(set(ids)) == len(ids) == 24
        assert request_ids(7, 1, 2) == ["s7-r1-0", "s7-r1-1"]


class TestRowMeta:
    def test_global_prompt_and_sample_index(self):
        """Rows of rank 1 continue rank 0's in the global batch; G consecutive rows share a prompt."""
        meta = row_meta(rank=1, num_rows=6, num_generations=4, weight_version=3)
        assert meta["prompt_index"] == [1, 1, 2, 2, 2, 2]
        assert meta["sample_index"] == [2, 3, 0, 1, 2, 3]
        assert meta["rank"] == [1] * 6 and meta["weight_version"] == [3] * 6

    def test_no_weight_version_before_any_sync(self):
        """Without a known sync the column is left out rather than filled with a fake value."""
        assert "weight_version" not in row_meta(0, 2, 2, None)


class TestToStepBatch:
    def test_rows_become_sequences_of_their_completion(self):
        """Each row keeps its completion tokens only; logprobs, ids, tokens and prompts line up."""
        out = trl_output()
        batch = to_step_batch(out, request_ids(0, 0, 3))
        assert batch.seq_lens.tolist() == [4, 2, 3]
        np.testing.assert_allclose(batch.logp_rollout[:2], [-0.1, -0.2], rtol=1e-6)
        d = batch.logp_train - batch.logp_rollout
        np.testing.assert_allclose(np.delete(d, 7), -0.01, atol=1e-6)
        assert batch.tokens.tolist()[:6] == [100, 101, 102, 103, 104, 105]
        assert [p.tolist() for p in batch.prompt_tokens] == [[5, 6], [7, 8, 9], [4]]
        assert np.isnan(batch.logp_rollout[7])  # kept: the monitor counts non-finite logprobs

    def test_tool_tokens_stay_masked_inside_the_sequence(self):
        """A tool-output token is part of its sequence but does not count."""
        batch = to_step_batch(trl_output(tool=True), request_ids(0, 0, 3))
        assert batch.seq_lens.tolist() == [4, 2, 3]
        assert batch.mask[:4].tolist() == [True, False, True, True]

    def test_truncated_row_masked_out_is_an_empty_sequence(self):
        """A row TRL masked out (mask_truncated_completions) becomes an empty sequence."""
        batch = to_step_batch(trl_output(truncated_row=1), request_ids(0, 0, 3))
        assert batch.seq_lens.tolist() == [4, 0, 3]

    def test_all_rows_masked_out_is_an_empty_step(self, tmp_path):
        """Every row masked out (all truncated): the batch builds and the Monitor logs an empty step
        with a warning instead of an exception that would stop TRL's training loop."""
        import json

        from rlcheck.core.monitor import Monitor, MonitorConfig

        out = trl_output()
        out["completion_mask"] = torch.zeros_like(out["completion_mask"])
        batch = to_step_batch(out, request_ids(0, 0, 3))
        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon, pytest.warns(UserWarning, match="no token"):
            report = mon.observe(0, batch)
        assert report.alarms == [] and report.metrics["rlcheck/token/count"] == 0
        assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["empty"] is True

    def test_logp_train_override(self):
        """`logp_train` replaces old_per_token_logps (the recomputation rlcheck does itself)."""
        out = trl_output()
        del out["old_per_token_logps"]
        batch = to_step_batch(out, request_ids(0, 0, 3), logp_train=out["sampling_per_token_logps"] - 0.5)
        np.testing.assert_allclose(np.nanmax(np.abs(batch.logp_train - batch.logp_rollout + 0.5)), 0, atol=1e-6)

    def test_missing_sampling_logprobs_is_an_input_error(self):
        """Without vLLM's logprobs the error names use_vllm."""
        out = trl_output()
        del out["sampling_per_token_logps"]
        with pytest.raises(InputError, match="use_vllm"):
            to_step_batch(out, request_ids(0, 0, 3))

    def test_missing_train_logprobs_is_an_input_error(self):
        """Without the trainer's logprobs the error says what to pass."""
        out = trl_output()
        del out["old_per_token_logps"]
        with pytest.raises(InputError, match="logp_train"):
            to_step_batch(out, request_ids(0, 0, 3))


class TestNewScalars:
    def test_only_new_values_under_prefixes(self):
        """Values TRL appended since the snapshot, under the prefixes, averaged and renamed trl/*."""
        metrics = {"sampling/x": [9.0, 1.0, 3.0], "reward": [0.5], "entropy": [2.0], "sampling/nan": [float("nan")]}
        got = new_scalars({"sampling/x": 1}, metrics)
        assert got == {"trl/sampling/x": 2.0, "trl/reward": 0.5}


class TestTRLOptions:
    def test_rejects_unknown_sync(self):
        """vllm_sync is auto, reload or trl."""
        with pytest.raises(ValueError, match="vllm_sync"):
            TRLOptions(vllm_sync="fast")

    def test_rejects_a_string_for_a_tuple(self):
        """trainer_metrics is a tuple of keys, not one key."""
        with pytest.raises(ValueError, match="tuples"):
            TRLOptions(trainer_metrics="rlcheck/token/abs_diff_mean")


@pytest.fixture(scope="module")
def grpo_config(tmp_path_factory):
    """`grpo_config(**fields) -> trl.GRPOConfig`: real TRL configs (CPU, no reporters)."""
    trl = pytest.importorskip("trl")
    out = str(tmp_path_factory.mktemp("grpo"))
    return lambda **kw: trl.GRPOConfig(**{"output_dir": out, "use_cpu": True, "report_to": [], "use_vllm": True, **kw})


class TestSamplingSettings:
    def test_trls_defaults_pass(self, grpo_config):
        """GRPOConfig's defaults (top_p 1, top_k 0, min_p None, repetition_penalty 1) sample the raw
        distribution: nothing to refuse; so do the explicit neutral values."""
        assert check_sampling(grpo_config()) == {}
        assert check_sampling(grpo_config(top_k=-1, min_p=0.0, generation_kwargs={"presence_penalty": 0.0})) == {}

    @pytest.mark.parametrize(("fields", "named"), [
        ({"top_p": 0.9}, "top_p=0.9"),
        ({"top_k": 50}, "top_k=50"),
        ({"min_p": 0.05}, "min_p=0.05"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"generation_kwargs": {"frequency_penalty": 0.5}}, "generation_kwargs['frequency_penalty']=0.5"),
    ])
    def test_each_setting_is_named_with_the_way_out(self, grpo_config, fields, named):
        """Each logit-processing setting is a ConfigError that names the field and the opt-out."""
        with pytest.raises(ConfigError) as err:
            check_sampling(grpo_config(**fields))
        assert named in str(err.value) and "allow_logit_processing=True" in str(err.value)

    def test_all_offenders_are_named_together(self, grpo_config):
        """Several settings are named in one error, so one edit fixes the config."""
        with pytest.raises(ConfigError, match="top_p=0.95, top_k=20, min_p=0.1, repetition_penalty=1.05"):
            check_sampling(grpo_config(top_p=0.95, top_k=20, min_p=0.1, repetition_penalty=1.05))

    def test_generation_kwargs_override_the_field(self, grpo_config):
        """vLLM takes generation_kwargs over the field (TRL updates its SamplingParams with them):
        a neutral override clears the field, a filter there is named as the kwargs entry, also from
        the JSON string a command line gives."""
        assert logit_processing(grpo_config(top_p=0.9, generation_kwargs={"top_p": 1.0})) == {}
        got = logit_processing(grpo_config(generation_kwargs='{"top_k": 5}'))
        assert got == {"generation_kwargs['top_k']": 5}

    def test_opt_out_warns_and_returns_the_settings(self, grpo_config):
        """allow_logit_processing=True: a RuntimeWarning naming the settings, which are returned."""
        with pytest.warns(RuntimeWarning, match="top_p=0.9"):
            assert check_sampling(grpo_config(top_p=0.9), allow=True) == {"top_p": 0.9}
        assert TRLOptions(allow_logit_processing=True).allow_logit_processing

    def test_recorded_in_the_context(self, grpo_config):
        """The monitor's context (every dump's meta.json) records the settings, {} when none."""
        from types import SimpleNamespace

        def trainer(args):
            return SimpleNamespace(args=args, model=SimpleNamespace(config=SimpleNamespace()), temperature=1.0,
                                   top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                   repetition_penalty=args.repetition_penalty, vllm_importance_sampling_correction=False,
                                   vllm_generation=None)

        assert trl_context(trainer(grpo_config(top_k=8)))["logit_processing"] == {"top_k": 8}
        assert trl_context(trainer(grpo_config()))["logit_processing"] == {}

    def test_drop_in_trainer_refuses_before_starting_vllm(self, grpo_config):
        """RLCheckGRPOTrainer raises the ConfigError before GRPOTrainer loads anything (the model
        path does not exist)."""
        from rlcheck.integrations.trl import RLCheckGRPOTrainer

        with pytest.raises(ConfigError, match="top_p=0.5"):
            RLCheckGRPOTrainer(model="/nonexistent/model", reward_funcs=len, args=grpo_config(top_p=0.5))

    @pytest.mark.supports("TRL", "steps_per_generation x num_iterations vs gradient_accumulation_steps",
                          "spg x iterations < GA", status="refused: ConfigError naming steps_per_generation, "
                          "num_iterations and gradient_accumulation_steps, before vLLM starts")
    @pytest.mark.parametrize("fields, match", [
        (dict(gradient_accumulation_steps=4, steps_per_generation=2), "steps_per_generation=2 x num_iterations=1 < gradient_accumulation_steps=4"),
        (dict(use_vllm=False), "use_vllm=True"),
        (dict(inject="stale-state"), "acts inside the rollout engine"),
    ])
    def test_config_refusals_come_before_grpo_trainer_init(self, grpo_config, monkeypatch, fields, match):
        """Refusals that need only the GRPOConfig are raised before GRPOTrainer.__init__ runs (which
        loads the model and starts vLLM: 51 s here, minutes on a GPU)."""
        import trl

        from rlcheck.integrations.trl import RLCheckGRPOTrainer

        def started(*args, **kwargs):
            raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

        monkeypatch.setattr(trl.GRPOTrainer, "__init__", started)
        options = TRLOptions(inject=fields.pop("inject")) if "inject" in fields else None
        with pytest.raises(ConfigError, match=re.escape(match)):
            RLCheckGRPOTrainer(model="/nonexistent/model", reward_funcs=len, args=grpo_config(**fields),
                               rlcheck_options=options)


class TestFault:
    def test_accepts_sync_and_data_faults(self):
        """Sync faults and data faults work with TRL."""
        assert _fault("stale-weights@3").name == "stale-weights"
        assert _fault(parse_inject("corrupt-seqs=0.5")).name == "corrupt-seqs"
        assert _fault(None).name == "none"

    @pytest.mark.parametrize("spec", ["temperature-mismatch=1.1", "stale-state"])
    def test_refuses_engine_and_trainer_config_faults(self, spec):
        """Faults that need rlcheck's own engine or trainer config are refused with a ConfigError."""
        with pytest.raises(ConfigError, match="sync faults"):
            _fault(spec)


class _Generation:
    """The two attributes of TRL's VLLMGeneration the sync wrapper reads, and a sync that counts."""

    def __init__(self, mode: str):
        self.mode = mode
        self.calls = 0

    def sync_weights(self):
        self.calls += 1


class TestWeightSync:
    def test_server_mode_keeps_trls_sync(self):
        """A vLLM server updates its own weights: auto picks TRL's sync, reload is refused."""
        assert resolve_method(_Generation("server"), "auto") == "trl"
        with pytest.raises(ConfigError, match="colocate"):
            resolve_method(_Generation("server"), "reload")

    def test_stale_weights_skips_from_onset(self):
        """stale-weights@3 leaves out the syncs before the rollouts of steps 3, 4, ...; synced_step
        stays at the last sync that ran."""
        gen, step = _Generation("server"), [0]
        sync = WeightSync(gen, lambda: step[0], "trl", parse_inject("stale-weights@3").skip_sync)
        for step[0] in range(6):
            gen.sync_weights()
        assert gen.calls == 3 and sync.synced_step == 2 and sync.skipped == [3, 4, 5]
        sync.uninstall()
        assert gen.sync_weights.__self__ is gen

    def test_skip_sync_every_k_is_periodic(self):
        """skip-sync-every=2 leaves out every second sync: the rollouts of steps 2, 4, ... are one update stale."""
        gen, step = _Generation("server"), [0]
        sync = WeightSync(gen, lambda: step[0], "trl", parse_inject("skip-sync-every=2").skip_sync)
        for step[0] in range(6):
            gen.sync_weights()
        assert sync.skipped == [2, 4]

    @pytest.mark.parametrize(("cost", "budget", "checked"), [
        (0.05, 0.02, [0, 1, 2, 3, 5, 8, 10, 13, 15, 18]),  # 5% of a step: three, then 2% of the time
        (0.01, 0.02, list(range(20))),  # within the budget: every sync
        (0.05, None, list(range(20))),  # no budget: every sync
        ((0.01, 0.05, 0.05, 0.01), 0.02, [0, 1, 2, *range(7, 20)]),  # the first three whatever they cost, then paid back
    ])
    def test_the_check_keeps_to_its_budget(self, monkeypatch, cost, budget, checked):
        """The sync check (colocate) is a token bucket of `budget` x wall time holding three checks: the
        first three syncs are checked whatever they cost (a second check 20x the first, as two loaded
        tensor-parallel ranks' once was, skipped the spoiled sync before), then as many as the budget pays
        for; its cost is the engine's fingerprint plus the stream's (here a 1 s step, an engine fingerprint
        of `cost` s)."""
        import types

        import rlcheck.engines.fingerprint as efp
        import rlcheck.integrations.trl.sync as ts
        import rlcheck.trainers.fingerprint as tfp

        clock = [0.0]

        costs = iter(cost if isinstance(cost, tuple) else ())

        def fingerprint(llm):
            clock[0] += next(costs, cost[-1]) if isinstance(cost, tuple) else cost
            return {}

        monkeypatch.setattr(ts, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        monkeypatch.setattr(ts, "engine_dtype", lambda vg: torch.float32)
        monkeypatch.setattr(tfp, "linear_tails", lambda model: set())
        monkeypatch.setattr(efp, "fingerprint_llm", fingerprint)
        gen, step = _Generation("colocate"), [0]
        gen.model, gen.llm, gen._iter_named_params = torch.nn.Linear(1, 1), None, lambda: iter(())
        sync = WeightSync(gen, lambda: step[0], "trl", budget=budget)
        for step[0] in range(20):
            clock[0] += 1.0
            gen.sync_weights()
        assert sync.checked == checked
        if not isinstance(cost, tuple):
            assert len(checked) * cost <= (budget or 1) * clock[0] + 3 * cost


# ---- quarantine: the hook on a stand-in trainer ---------------------------------------------------

BAD_ROW = 7


def grpo_output(num_rows: int = 20, bad_row: int | None = BAD_ROW) -> dict:
    """A TRL step output of `num_rows` rows of 6 completion tokens (the last one padding), as
    `_generate_and_score_completions` returns it with vLLM's IS correction on; the trainer's
    logprobs of `bad_row` 3 nats off vLLM's (a catastrophic sequence)."""
    gen = torch.Generator().manual_seed(0)
    cm = torch.ones(num_rows, 6, dtype=torch.long)  # (B, C)
    cm[:, -1] = 0
    sampling = -torch.rand(num_rows, 6, generator=gen) * cm  # (B, C)
    old = sampling - 1e-3 * cm
    if bad_row is not None:
        old[bad_row] -= 3.0
    return {
        "prompt_ids": torch.ones(num_rows, 2, dtype=torch.long), "prompt_mask": torch.ones(num_rows, 2, dtype=torch.long),
        "completion_ids": torch.arange(num_rows * 6).reshape(num_rows, 6) * cm, "completion_mask": cm,
        "sampling_per_token_logps": sampling, "old_per_token_logps": old,
        "importance_sampling_ratio": torch.exp(old - sampling) * cm,
        "num_items_in_batch": cm.sum(), "advantages": torch.zeros(num_rows),
    }


def stand_in_trainer():
    """The attributes of a `trl.GRPOTrainer` the hook reads (one process, TRL's vLLM server mode)."""
    from collections import defaultdict
    from types import SimpleNamespace

    args = SimpleNamespace(use_vllm=True, steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1,
                           output_dir=".")
    return SimpleNamespace(
        use_vllm=True, args=args, num_iterations=1, num_generations=4, vllm_generation=_Generation("server"),
        accelerator=SimpleNamespace(process_index=0, num_processes=1), state=SimpleNamespace(global_step=0),
        _metrics={"train": defaultdict(list)}, add_callback=lambda cb: None,
    )


@pytest.fixture
def hook(tmp_path):
    """`hook(quarantine=True, **options) -> RLCheckHook` on a stand-in trainer, with a real Monitor."""
    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.core.quarantine import QuarantineConfig
    from rlcheck.integrations.trl import RLCheckHook

    monitors = []

    def make(quarantine: bool = True, **options) -> RLCheckHook:
        cfg = MonitorConfig(run_dir=tmp_path / f"run{len(monitors)}", sinks=("jsonl",),
                            quarantine=QuarantineConfig() if quarantine else None)
        monitors.append(Monitor(cfg))
        return RLCheckHook(stand_in_trainer(), monitors[-1], TRLOptions(**options))

    yield make
    for m in monitors:
        m.close()


class TestQuarantinedRows:
    def test_rows_by_request_id(self):
        """Quarantined sequences map to their rows through their request ids, in row order."""
        from types import SimpleNamespace

        got = quarantined_rows(request_ids(3, 1, 5), [SimpleNamespace(request_id=r) for r in ("s3-r1-4", "s3-r1-0")])
        assert got == [0, 4]

    def test_mask_rows_counts_loss_tokens_and_leaves_the_old_tensor(self):
        """The rows' loss tokens (tool output not counted) are returned; the dict gets a new mask, zero
        on those rows; the tensor TRL made is not written to."""
        out = trl_output(tool=True)
        before = out["completion_mask"]
        assert mask_rows(out, [0, 2]) == 3 + 3
        assert out["completion_mask"].tolist() == [[0] * 4, [1, 1, 0, 0], [0] * 4]
        assert before.tolist() == [[1] * 4, [1, 1, 0, 0], [1, 1, 1, 0]]
        assert mask_rows(out, []) == 0


class TestQuarantineInTheLoss:
    def test_quarantined_row_leaves_the_loss(self, hook):
        """With quarantine on, the corrupted row's completion_mask is zeroed and its tokens leave
        num_items_in_batch; every other row and TRL's IS ratios are as TRL made them; TRL's logs
        get the counts."""
        h, out = hook(), grpo_output()
        mask, ratio = out["completion_mask"].clone(), out["importance_sampling_ratio"]
        report = h.observe(out)
        assert [q.request_id for q in report.quarantined] == [f"s0-r0-{BAD_ROW}"]
        assert report.keep.tolist() == [i != BAD_ROW for i in range(20)]
        assert out["completion_mask"][BAD_ROW].sum() == 0
        keep = torch.arange(20) != BAD_ROW
        assert torch.equal(out["completion_mask"][keep], mask[keep])
        assert out["importance_sampling_ratio"] is ratio
        assert int(out["num_items_in_batch"]) == int(mask.sum()) - 5
        logged = h.trainer._metrics["train"]
        assert logged["rlcheck/trl/dropped_sequences"] == [1.0] and logged["rlcheck/trl/dropped_tokens"] == [5.0]
        assert not report.halted and report.metrics["rlcheck/quarantine/count"] == 1

    def test_dry_run_leaves_the_mask(self, hook):
        """mask_quarantined=False: the Monitor still quarantines the row, TRL's tensors stay as they are."""
        h, out = hook(mask_quarantined=False), grpo_output()
        mask = out["completion_mask"]
        report = h.observe(out)
        assert len(report.quarantined) == 1
        assert out["completion_mask"] is mask and "rlcheck/trl/dropped_sequences" not in h.trainer._metrics["train"]

    def test_quarantine_off_changes_nothing(self, hook):
        """Without quarantine the output keeps its own mask and a clean step logs no drop."""
        h, out = hook(quarantine=False), grpo_output(bad_row=None)
        mask = out["completion_mask"]
        h.observe(out)
        assert out["completion_mask"] is mask and "rlcheck/trl/dropped_tokens" not in h.trainer._metrics["train"]


class TestKeptLoss:
    """`kept_loss` on a stand-in `_compute_loss` (the real one: tests/integration/test_trl_loss.py)."""

    @staticmethod
    def seen(model, inputs):
        return inputs

    def test_several_processes_gather_the_same_shape(self):
        """With 2 processes, a per-row tensor TRL gathers inside the loss is padded back to B rows with
        NaN; scalars go as they are; the accelerator's own gather is back afterwards."""
        from types import SimpleNamespace

        from rlcheck.integrations.trl.loss import kept_loss, mark_kept

        shapes = []
        acc = SimpleNamespace(num_processes=2, gather=lambda t: shapes.append(tuple(t.shape)) or t)
        own = acc.gather

        def compute(model, inputs):
            assert inputs["advantages"].shape == (2,) and "rlcheck_keep" not in inputs
            acc.gather(torch.ones(2))  # TRL's per-row clip ratios
            return acc.gather(torch.tensor(0.5))  # its policy loss

        out = {"completion_mask": torch.ones(3, 4), "advantages": torch.arange(3.0), "num_items_in_batch": torch.tensor(8)}
        mark_kept(out, [1])
        assert float(kept_loss(compute, acc, None, out)) == 0.5
        assert shapes == [(3,), ()] and acc.gather is own

    def test_multimodal_rows_stay_masked_with_a_warning(self):
        """Pixel values are not indexed by row: the rows stay (masked), their NaN zeroed, and a warning
        says the loss is diluted."""
        from rlcheck.integrations.trl.loss import kept_loss, mark_kept

        logps = torch.tensor([[0.1, float("nan")], [0.2, 0.3]], dtype=torch.float64)
        out = {"completion_mask": torch.ones(2, 2), "old_per_token_logps": logps, "pixel_values": torch.ones(5, 3)}
        mark_kept(out, [0])
        with pytest.warns(RuntimeWarning, match="masked, not removed"):
            seen = kept_loss(self.seen, None, None, out)
        assert seen["old_per_token_logps"].tolist() == [[0.1, 0.0], [0.2, 0.3]] and seen["pixel_values"].shape == (5, 3)


# ---- top-k: vLLM's per-position lists, the trainer's extra forward ---------------------------------

def _rank_lists(logp: np.ndarray, sampled: int, k: int) -> tuple[list[int], list[float]]:
    """One position as TRL's VLLMGeneration returns it with logprobs=k: the top-k ids by rank, then the
    sampled token if it is not among them, and their logprobs."""
    ids = [int(i) for i in np.argsort(-logp, kind="stable")[:k]]
    if sampled not in ids:
        ids.append(sampled)
    return ids, [float(logp[i]) for i in ids]


class _TopKGeneration(_Generation):
    """TRL's VLLMGeneration for top-k: `logprobs` and a `generate` returning fixed per-position lists."""

    def __init__(self, completions, lists):
        super().__init__("server")
        self.logprobs, self.generation_kwargs, self.completions, self.lists = 0, {}, completions, lists

    def generate(self, prompts=None, images=None, num_generations=1, profiler=None):
        ids = [[i for i, _ in seq] for seq in self.lists]
        lps = [[lp for _, lp in seq] for seq in self.lists]
        return [[1]] * len(self.completions), self.completions, lps, ids


class TestSplitSampled:
    def test_trl_gets_the_sampled_tokens_logprob_and_rlcheck_the_top_k(self):
        """lp[0] of what TRL gets back is the sampled token's logprob, also when it is not the top-1
        or sits past the top-k (vLLM's extra entry, dropped from the top-k); NaN (None) stays None."""
        sampled_lp, sampled_ids, tops = split_sampled(
            [[5, 7, 6]], [[[-0.1, -2.0, -3.0], [-0.5, -1.0, -4.0], [None, -0.2]]], [[[5, 6, 9], [6, 8, 7], [6, 4]]], 2)
        assert sampled_lp == [[[-0.1], [-4.0], [None]]] and sampled_ids == [[[5], [7], [6]]]
        ids, lp = tops[0]
        assert ids.tolist() == [[5, 6], [6, 8], [4, -1]]
        np.testing.assert_allclose(lp, [[-0.1, -2.0], [-0.5, -1.0], [-0.2, -np.inf]])


class TestEngineTopK:
    def test_wraps_generate_and_forgets_after_take(self):
        """Installing sets logprobs=K and wraps generate; take() gives the last call's rows once;
        uninstall restores TRL's generate and logprobs=0."""
        gen = _TopKGeneration([[3]], [[([3, 1], [-0.3, -1.5])]])
        topk = EngineTopK(gen, 2)
        assert gen.logprobs == 2
        _, _, lps, _ = gen.generate()
        assert lps == [[[-0.3]]]
        assert topk.take()[0][0].tolist() == [[3, 1]] and topk.take() is None
        topk.uninstall()
        assert gen.generate.__func__ is _TopKGeneration.generate and gen.logprobs == 0


class TestStepTopK:
    def test_padded_rows_line_up_with_completion_positions(self):
        """Row b*C + t of the step's TopK is completion position (b, t); to_step_batch keeps the rows
        of each completion's tokens, in order."""
        out = trl_output()  # completions of 4, 2 and 3 tokens, C = 4
        rows = [(np.arange(n * 2).reshape(n, 2) + 10 * b, np.full((n, 2), -1.0, np.float32) - b)
                for b, n in enumerate([4, 2, 3])]
        ids, lp = padded_engine_topk(rows, 4, 2)
        assert ids.shape == (3, 4, 2) and ids[1, 2:].tolist() == [[-1, -1]] * 2 and np.isinf(lp[1, 2:]).all()
        topk = step_topk(ids, lp, np.where(ids >= 0, -2.0, -np.inf), ids[..., ::-1])
        assert topk.num_tokens == 12
        batch = to_step_batch(out, request_ids(0, 0, 3), topk=topk)
        kept = np.concatenate([r[0] for r in rows])
        np.testing.assert_array_equal(batch.topk.ids_rollout, kept)
        np.testing.assert_array_equal(batch.topk.logp_rollout[:, 0], np.repeat([-1.0, -2.0, -3.0], [4, 2, 3]))

    def test_more_top_k_rows_than_columns_is_an_input_error(self):
        """A completion longer than TRL's padded tensor means the rows do not belong to this step."""
        with pytest.raises(InputError, match="completion 0"):
            padded_engine_topk([(np.zeros((5, 1), np.int64), np.zeros((5, 1), np.float32))], 4, 1)


class TestTopKOptions:
    def test_top_k_follows_the_distribution_stats_unless_given(self):
        """None: K=20 with StatsConfig(distribution=True), off without; an explicit K wins; negatives refused."""
        assert resolve_top_k(None, True) == DEFAULT_TOP_K and resolve_top_k(None, False) == 0
        assert resolve_top_k(0, True) == 0 and resolve_top_k(5, False) == 5
        with pytest.raises(ConfigError, match="top_logprobs"):
            TRLOptions(top_logprobs=-1)

    @pytest.mark.parametrize("attr, value, match", [
        ("rollout_func", lambda p, t: None, "rollout_func"), ("tools", [print], "tools"),
        ("generation_kwargs", {"logprobs": 5}, "generation_kwargs")])
    def test_refused_generation_paths_are_named(self, attr, value, match):
        """rollout_func, tools and a logprobs entry in generation_kwargs cannot give the top-k: ConfigError."""
        trainer = stand_in_trainer()
        trainer.vllm_generation.generation_kwargs = {}
        setattr(trainer.vllm_generation if attr == "generation_kwargs" else trainer, attr, value)
        with pytest.raises(ConfigError, match=match):
            check_topk(trainer, 20)

    def test_k_over_the_engines_max_logprobs_is_refused(self):
        """Colocate: vLLM returns at most its max_logprobs (20 by default) per position."""
        from types import SimpleNamespace

        trainer = stand_in_trainer()
        config = SimpleNamespace(model_config=SimpleNamespace(max_logprobs=20))
        trainer.vllm_generation.llm = SimpleNamespace(llm_engine=config)
        check_topk(trainer, 20)
        with pytest.raises(ConfigError, match="max_logprobs=20"):
            check_topk(trainer, 21)

    def test_a_monitor_without_distribution_stats_is_refused(self, hook):
        """A Monitor passed in with distribution=False would drop the top-k: ConfigError, not silence."""
        with pytest.raises(ConfigError, match="distribution=False"):
            hook(quarantine=False, top_logprobs=4)


class TestTopKThroughTheHook:
    def test_engine_equal_to_the_trainer_logs_zero_kl(self, tmp_path, monkeypatch):
        """An engine whose top-k lists come from the trainer's own model at TRL's temperature: the
        extra forward scores the same ids at the same positions (left-padded prompts, padded
        completions), so the step's KL is ~0, the top-k sets agree, and the sampled-token logprob
        handed to TRL is the sampled token's."""
        from contextlib import nullcontext

        from rlcheck.core import metrics as K
        from rlcheck.core.monitor import MonitorConfig
        from rlcheck.integrations import trl
        from rlcheck.synthetic.streams import tiny_causal_lm

        out, k, temperature = trl_output(), 3, 0.7
        out["completion_ids"] = out["completion_ids"] % 64  # the tiny model's vocabulary
        model = tiny_causal_lm("llama", vocab_size=64).eval()
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)  # (B, P+C)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            logp = (model(ids, attention_mask=attention).logits.float() / temperature).log_softmax(-1)[:, 2:-1]
        sampled = logp.gather(-1, out["completion_ids"][..., None])[..., 0] * out["completion_mask"]  # (B, C)
        out["sampling_per_token_logps"], out["old_per_token_logps"] = sampled, sampled.clone()
        completions = [row[: int(m.sum())].tolist() for row, m in zip(out["completion_ids"], out["completion_mask"], strict=True)]
        lists = [[_rank_lists(logp[b, t].numpy(), tok, k) for t, tok in enumerate(seq)]
                 for b, seq in enumerate(completions)]
        trainer = stand_in_trainer()
        trainer.vllm_generation = _TopKGeneration(completions, lists)
        trainer.model, trainer.temperature = model, temperature
        trainer.args.per_device_train_batch_size = 2  # two chunks of rows
        trainer.accelerator.autocast = nullcontext
        monkeypatch.setattr(trl.hook, "trl_context", lambda trainer: {})  # the stand-in has no GRPOConfig
        h = trl.RLCheckHook(trainer, MonitorConfig(run_dir=tmp_path / "run", sinks=("jsonl",)), TRLOptions(top_logprobs=k))
        try:
            _, _, lps, _ = trainer.vllm_generation.generate()
            for b, seq in enumerate(completions):
                np.testing.assert_allclose([lp[0] for lp in lps[b]], logp[b, range(len(seq)), seq], rtol=1e-6)
            report = h.observe(out, topk_rows=h.engine_topk.take())
        finally:
            h.close()
        m = report.metrics
        assert h.monitor_config.stats.distribution and m[K.DIST_COUNT] == 9
        assert m[K.DIST_KL_MEAN] < 1e-6 and m[K.DIST_TOPK_OVERLAP_MEAN] == 1.0 and m[K.DIST_TOP1_AGREE_FRAC] == 1.0


class TestFreshRun:
    """A fresh train() in a reused output_dir starts a new run; a resumed one continues the old."""

    @staticmethod
    def _old_run(run_dir):
        import numpy as np

        from rlcheck import Monitor, MonitorConfig, StepBatch

        rng = np.random.default_rng(0)
        lr = [-rng.exponential(1.0, 20) - 0.01 for _ in range(4)]
        batch = StepBatch.from_ragged(lr, [x - rng.uniform(0, 1e-3, 20) for x in lr], [f"r{i}" for i in range(4)])
        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
            mon.observe(0, batch)
            mon.observe(1, batch)

    def test_fresh_train_keeps_the_old_run_aside(self, tmp_path):
        """At global_step 0 the earlier run moves to <run_dir>.prev-1 (one warning names it) and a new
        Monitor there starts from nothing: it does not resume, nor see the old steps."""
        from rlcheck import Monitor, MonitorConfig
        from rlcheck.integrations.trl.rundir import start_run

        run_dir = tmp_path / "rlcheck"
        self._old_run(run_dir)
        with pytest.warns(UserWarning, match=r"held an earlier run; it is kept as .*rlcheck\.prev-1"):
            kept = start_run(run_dir, 0)
        assert kept == tmp_path / "rlcheck.prev-1" and (kept / "metrics.jsonl").read_text().count("\n") == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "resuming" warning
            with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon:
                assert mon.last_step is None
        self._old_run(tmp_path / "other")
        assert start_run(tmp_path / "other", 0) == tmp_path / "other.prev-1"

    def test_resumed_train_continues_the_run(self, tmp_path):
        """A train(resume_from_checkpoint=...) (global_step > 0 at on_train_begin) leaves the run in place."""
        from rlcheck.integrations.trl.rundir import start_run

        run_dir = tmp_path / "rlcheck"
        self._old_run(run_dir)
        assert start_run(run_dir, 2) is None and (run_dir / "state.json").exists()
        assert start_run(tmp_path / "empty", 0) is None
