"""`token_logprobs` of an FSDP2- or DeepSpeed-ZeRO-3-wrapped model equals the plain model's.

Two processes on localhost (gloo, CPU) wrap the same tiny Llama (every decoder layer and the root
sharded, so the LM head and embeddings are partitioned across the ranks), score the same batch and
backprop the summed logprobs; each rank pickles its logprobs and the full gradients of the LM head
and of one layer to the test, which compares them with one unwrapped process.
"""

from __future__ import annotations

import os
import pickle
import socket

import pytest
import torch

from rlcheck.synthetic.streams import tiny_causal_lm

WORLD_SIZE = 2
V = 512


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_llama():
    return tiny_causal_lm("llama", vocab_size=V, tie_word_embeddings=False)


def _batch() -> torch.Tensor:
    return torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))


GRAD_NAMES = ("lm_head.weight", "model.layers.1.mlp.down_proj.weight")


def _plain() -> tuple:
    model = _tiny_llama()
    from rlcheck.trainers.logprobs import token_logprobs

    logp = token_logprobs(model, _batch(), temperature=0.8, chunk_size=5).logp
    logp.sum().backward()
    params = dict(model.named_parameters())
    return logp.detach(), {n: params[n].grad for n in GRAD_NAMES}


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    logp = _score(model)
    logp.sum().backward()
    params = dict(model.named_parameters())
    grads = {n: params[n].grad.full_tensor() for n in GRAD_NAMES}  # mean over ranks, same data
    return logp.detach(), grads


def _deepspeed(model):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.module.lm_head.weight.numel() == 0  # partitioned: the test means something
    logp = _score(engine)
    engine.backward(logp.sum())
    params = dict(engine.module.named_parameters())
    grads = {n: safe_get_full_grad(params[n]) for n in GRAD_NAMES}  # mean over ranks, same data
    return logp.detach(), grads


def _score(model) -> torch.Tensor:
    from rlcheck.trainers.logprobs import token_logprobs

    return token_logprobs(model, _batch(), temperature=0.8, chunk_size=5).logp


def _rank_main(rank: int, port: int, kind: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        DS_ACCELERATOR="cpu",
    )
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        if kind == "deepspeed":
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else it compiles for a minute
        result = (_fsdp2 if kind == "fsdp2" else _deepspeed)(_tiny_llama())
    except Exception as exc:  # noqa: BLE001 - handed to the test, which fails with it
        result = RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # Leave without interpreter teardown: a DeepSpeed/gloo thread still alive there can abort the
    # process ("terminate called without an active exception") after the results are written.
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestWrappedModels:
    @pytest.mark.parametrize("kind", ["fsdp2", "deepspeed"])
    def test_equals_plain_model(self, tmp_path, kind):
        """Logprobs (rtol 1e-5) and gradients of LM head and a layer (rtol 1e-4) equal the plain model's."""
        import torch.multiprocessing as mp

        if kind == "deepspeed":
            pytest.importorskip("deepspeed")
        want_logp, want_grads = _plain()
        mp.spawn(_rank_main, args=(_free_port(), kind, str(tmp_path)), nprocs=WORLD_SIZE, join=True)
        for rank in range(WORLD_SIZE):
            with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
                result = pickle.load(f)
            if isinstance(result, Exception):
                raise result
            logp, grads = result
            torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-6)
            for name in GRAD_NAMES:
                want = want_grads[name]
                torch.testing.assert_close(
                    grads[name], want, rtol=1e-4, atol=1e-5 * want.abs().max().item(), msg=name
                )
