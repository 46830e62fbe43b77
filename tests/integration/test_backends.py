"""The trainer backends' precision and weight gathering on two gloo ranks (CPU, the tiny Llama):

- FSDP2 with dtype bfloat16 updates float32 master weights (`MixedPrecisionPolicy`): one step moves
  the weights as a float32 trainer does, the forward computes in bfloat16, and the synced weights
  are bfloat16.
- DeepSpeed ZeRO-3 `full_state_dict` gathers a group of parameters at a time: the same tensors as
  gathering the whole model at once, on rank 0 only, and no rank ever holds more than one group.

Each rank runs in a process of its own (torch.multiprocessing.spawn) and pickles its results back.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rlcheck.trainers import MicroBatchPlan, PolicyTrainer, TrainerConfig, plan_micro_batches  # noqa: E402
from tests.integration.test_distributed import _free_port  # noqa: E402
from tests.integration.test_trainers import in_order, sequences, update_inputs  # noqa: E402

WORLD_SIZE = 2
LR = 1e-6  # GPU recipes' default: AdamW steps of ~1e-6, far under a bf16 spacing
BUDGET = 40


def _rank_main(rank: int, port: int, task: str, cfg: TrainerConfig, batch, out_dir: str) -> None:
    """One rank: join the gloo group, run `task`, pickle what it returns to out_dir/rank<r>.pkl."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(WORLD_SIZE))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        trainer = PolicyTrainer(cfg, rank, WORLD_SIZE)
        result = TASKS[task](trainer, batch)
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def _fsdp2_step(trainer: PolicyTrainer, batch) -> dict:
    """The master weights before and after one step, the dtypes the first attention projection computed
    in, the logprobs before the step and the synced weights after it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = trainer.backend.module
    seen = []
    q_proj = module.get_decoder().layers[0].self_attn.q_proj
    hook = q_proj.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    plan = plan_micro_batches(batch, WORLD_SIZE, BUDGET)
    before = get_model_state_dict(module, options=options)
    logp = trainer.logprobs(batch, plan)
    trainer.train_step(batch, plan)
    hook.remove()
    after = get_model_state_dict(module, options=options)
    synced = trainer.full_state_dict()
    return {"before": before, "after": after, "computed_in": set(seen), "logp": logp, "synced": synced}


def _zero3_gather(trainer: PolicyTrainer, batch) -> dict:
    """One step, then the new per-group gather (`full_state_dict`, and `zero3_state_dict` one parameter
    at a time, counting the parameters gathered at each item) and the old whole-model gather."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from rlcheck.trainers.backends import zero3_state_dict

    trainer.train_step(batch, plan_micro_batches(batch, WORLD_SIZE, BUDGET))
    module = trainer.backend.engine.module
    params = list(module.parameters())
    new = trainer.full_state_dict()
    held, one_by_one = [], []
    for n, t in zero3_state_dict(module, max_numel=1):
        held.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in params))
        if trainer.rank == 0:
            one_by_one.append((n, t.cpu().clone()))
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        old = [(n, t.detach().cpu().clone()) for n, t in module.state_dict().items()]
    partitioned = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params)
    return {"new": new, "one_by_one": one_by_one, "old": old, "max_held": max(held), "partitioned_after": partitioned}


TASKS = {"fsdp2": _fsdp2_step, "zero3": _zero3_gather}


def _run(task: str, cfg: TrainerConfig, batch, out_dir) -> list:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(_free_port(), task, cfg, batch, str(out_dir)), nprocs=WORLD_SIZE, join=True)
    return [pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def bf16_llama(tiny_model, tmp_path_factory):
    """The tiny Llama rounded to bfloat16 and saved: the float32 reference then starts from exactly the
    values a bf16 load gives the FSDP2 master weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = tiny_model("llama"), tmp_path_factory.mktemp("llama-bf16")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return str(dst)


def _moved(before: dict, after: dict) -> tuple[torch.Tensor, float]:
    """The update of every weight (flattened, in name order, float32) and the share of weights it moved."""
    delta = torch.cat([(after[n].float() - before[n].float()).flatten() for n in sorted(before)])
    return delta, float((delta != 0).float().mean())


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestFSDP2MixedPrecision:
    def test_bf16_step_moves_weights_as_float32(self, bf16_llama, tmp_path):
        """A bf16 FSDP2 step updates float32 masters like a float32 trainer, computes in bf16, syncs bf16."""
        cfg = TrainerConfig(model=bf16_llama, backend="fsdp2", dtype="bfloat16", lr=LR, micro_batch_tokens=BUDGET)
        bf16 = PolicyTrainer(replace(cfg, backend="hf"))  # what a bf16 engine computes
        seqs = sequences(0, 12)
        plan = plan_micro_batches(seqs, 1, BUDGET)
        # the ranks' micro-batches on one process: bf16 results depend on the batching (2.6e-2 here)
        same_batches = MicroBatchPlan((tuple(mb for r in plan_micro_batches(seqs, WORLD_SIZE, BUDGET).ranks
                                             for mb in r if mb),))
        want_logp = in_order(bf16.logprobs(seqs, same_batches))
        batch = update_inputs(seqs, want_logp, seed=0)
        ref = PolicyTrainer(replace(cfg, backend="hf", dtype="float32"))
        ref_before = dict(ref.full_state_dict())
        ref.train_step(batch, plan)
        ref_delta, ref_share = _moved(ref_before, dict(ref.full_state_dict()))

        rank0, rank1 = _run("fsdp2", cfg, batch, tmp_path)
        assert rank0["computed_in"] == {(torch.bfloat16, torch.bfloat16)}
        assert all(t.dtype == torch.float32 for t in rank0["before"].values())  # master weights
        assert all(torch.equal(rank0["before"][n], t) for n, t in ref_before.items())  # the same start
        logp = {**rank0["logp"], **rank1["logp"]}
        gap = max(np.abs(logp[i] - w).max() for i, w in enumerate(want_logp))
        assert gap < 1e-4, f"FSDP2 bf16 logprobs {gap:.2e} from a bf16 model's (a float32 model's: 5.7e-2)"

        delta, share = _moved(rank0["before"], rank0["after"])
        assert share > 0.9 * ref_share, f"moved {share:.1%} of the weights, float32 {ref_share:.1%}"
        big = ref_delta.abs() > 0.5 * LR  # elements float32 moved by ~lr (not a ~0 gradient)
        assert (torch.sign(delta[big]) == torch.sign(ref_delta[big])).float().mean() > 0.95
        assert (delta - ref_delta).norm() < 0.25 * ref_delta.norm()

        assert rank1["synced"] is None
        synced = dict(rank0["synced"])
        assert synced.keys() == rank0["after"].keys()
        assert all(t.dtype == torch.bfloat16 for t in synced.values())
        assert all(torch.equal(synced[n], t.bfloat16()) for n, t in rank0["after"].items())


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestHFMasters:
    def test_bf16_step_moves_float32_masters_as_float32(self, bf16_llama):
        """The plain `hf` backend in bf16: the forward is the bf16 model's (the engine's computation), the
        update lands in float32 masters like a float32 trainer's (before: 1.1% of the weights moved, 1.4%
        sign agreement), and the model and its synced weights are the masters rounded to bf16."""
        cfg = TrainerConfig(model=bf16_llama, backend="hf", dtype="bfloat16", lr=LR, micro_batch_tokens=BUDGET)
        seqs = sequences(0, 12)
        plan = plan_micro_batches(seqs, 1, BUDGET)
        t = PolicyTrainer(cfg)
        names = [n for n, p in t.backend.module.named_parameters() if p.requires_grad]
        before = {n: m.clone() for n, m in zip(names, t.backend.masters, strict=True)}
        ref = PolicyTrainer(replace(cfg, dtype="float32"))
        ref_before = {n: w for n, w in ref.full_state_dict() if n in before}
        assert all(torch.equal(before[n], ref_before[n]) for n in names)  # the same start
        batch = update_inputs(seqs, in_order(ref.logprobs(seqs, plan)), seed=0)
        ref.train_step(batch, plan)
        ref_delta, ref_share = _moved(ref_before, {n: w for n, w in ref.full_state_dict() if n in before})

        t.train_step(batch, plan)
        after = dict(zip(names, t.backend.masters, strict=True))
        delta, share = _moved(before, after)
        named = dict(t.backend.module.named_parameters())
        assert all(named[n].dtype == torch.bfloat16 and torch.equal(named[n], after[n].bfloat16()) for n in names)
        assert share > 0.9 * ref_share, f"moved {share:.1%} of the weights, float32 {ref_share:.1%}"
        big = ref_delta.abs() > 0.5 * LR
        assert (torch.sign(delta[big]) == torch.sign(ref_delta[big])).float().mean() > 0.95
        assert all(w.dtype == torch.bfloat16 for _, w in t.full_state_dict())


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestZero3Gather:
    def test_grouped_gather_equals_whole_model(self, tiny_model, tmp_path):
        """Rank 0 gets the whole-model gather's names and tensors; rank 1 None; one group held at a time."""
        pytest.importorskip("deepspeed")
        cfg = TrainerConfig(model=str(tiny_model("llama")), backend="deepspeed", zero_stage=3, lr=1e-4,
                            micro_batch_tokens=BUDGET)
        seqs = sequences(0, 8)
        batch = update_inputs(seqs, [np.full(len(r), -7.0, np.float32) for r in seqs.responses], seed=0)
        rank0, rank1 = _run("zero3", cfg, batch, tmp_path)
        assert rank1["new"] is None
        old = rank0["old"]
        for new in (rank0["new"], rank0["one_by_one"]):
            assert [n for n, _ in new] == [n for n, _ in old]
            assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(new, old, strict=True))
        for r in (rank0, rank1):
            assert r["max_held"] == 1  # one parameter at a time with max_numel=1
            assert r["partitioned_after"]
