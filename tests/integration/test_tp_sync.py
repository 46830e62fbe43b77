"""Weight syncs into a tensor-parallel engine (vLLM's mp executor, two workers, one core each): the
collective sync received by each worker itself, and the stale-buffer fault keeping each worker's own
conv buffers (`rlcheck.engines.vllm_worker_sync`, `rlcheck.engines.vllm_sync.StaleConvBuffers`)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rlcheck.engines.vllm import VLLMConfig, VLLMEngine  # noqa: E402
from rlcheck.engines.vllm_collective import SyncGroup, send_weights  # noqa: E402
from rlcheck.engines.vllm_sync import conv_mixers, count_conv_mixers, keep_conv_buffers_stale  # noqa: E402
from rlcheck.engines.vllm_worker_sync import join_workers, receive_into  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The tiny hybrid (Mamba2 + attention) on two tensor-parallel workers, float32."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    eng = VLLMEngine(VLLMConfig(model=str(tiny_model("hybrid")), greedy=True, max_tokens=6, kv_cache_bytes=64 << 20,
                                max_model_len=256, tensor_parallel_size=2,
                                engine_kwargs={"distributed_executor_backend": "mp"}))
    yield eng
    eng.close()
    mp.undo()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(model_dir, scale: float, seed: int):
    """The checkpoint's weights, each multiplied by `scale` and moved by noise of its own size."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale).add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    return model


def _collective_sync(engine, weights: list, version: int, bucket_bytes: int = 1 << 18) -> dict:
    """Trainer rank 0 (a thread here) sends `weights`; the engine's workers join and receive them."""
    port, groups, sent = _port(), {}, {}
    server = threading.Thread(target=lambda: groups.setdefault(0, SyncGroup("127.0.0.1", port, 0, 3, 60.0)))
    server.start()
    assert join_workers(engine, "127.0.0.1", port, 3, 60.0) == 2
    server.join()
    sender = threading.Thread(target=lambda: sent.update(send_weights(groups[0], weights, bucket_bytes)))
    sender.start()
    stats = receive_into(engine, version)
    sender.join()
    return {**stats, "sent": sent}


PROMPTS = [[5, 17, 33, 9], [2, 8, 101, 77, 12, 4]]


def conv_buffers(model):
    """A worker's Mamba conv buffers, copied (runs inside each worker)."""
    return {name: mixer.conv_weights.detach().clone() for name, mixer in conv_mixers(model)}


class TestTensorParallelSync:
    def test_each_worker_receives_and_loads_its_shard(self, engine, tiny_model):
        """Over a gloo group of trainer rank 0 and the two workers, each worker receives every bucket
        itself (none lands in the actor's process) and loads its shard: the engine's greedy logprobs
        then equal the HF reference's of the new weights, and differ from the old ones'."""
        from rlcheck.engines.hf import HFScorer, HFScorerConfig

        model = _weights(tiny_model("hybrid"), 0.9, seed=1)
        before = engine.generate(PROMPTS, step=0)
        stats = _collective_sync(engine, list(model.state_dict().items()), version=engine.weight_version + 1)
        assert stats["workers"] == 2 and stats["bytes"] == stats["sent"]["bytes"] and stats["buckets"] > 1
        assert not hasattr(engine, "sync_group")  # nothing of the sync in the actor's process
        after = engine.generate(PROMPTS, step=1)
        ref = HFScorer(HFScorerConfig(model="in-process"), model=model.eval()).score(
            PROMPTS, [list(r.token_ids) for r in after])
        assert max(float(np.abs(r.logprobs - lp).max()) for r, lp in zip(after, ref, strict=True)) < 1e-3
        assert any(r.token_ids != b.token_ids or float(np.abs(r.logprobs - b.logprobs).max()) > 1e-2
                   for r, b in zip(after, before, strict=True))

    def test_stale_buffer_keeps_each_workers_own_buffers(self, engine, tiny_model):
        """stale-buffer on two workers: after a sync, each worker's conv buffers are its own from before
        the sync (its own channels' shard), not worker 0's copied into both."""
        old = engine.llm.apply_model(conv_buffers)  # one dict per worker
        assert len(old) == 2 and any(not torch.equal(old[0][k], old[1][k]) for k in old[0])
        handle = keep_conv_buffers_stale(engine)
        try:
            model = _weights(tiny_model("hybrid"), 1.1, seed=2)
            engine.sync_weights(list(model.state_dict().items()), engine.weight_version + 1)
        finally:
            handle.remove()
        now = engine.llm.apply_model(conv_buffers)
        assert handle.syncs == 1 and len(now) == 2
        for worker in range(2):
            assert all(torch.equal(now[worker][k], old[worker][k]) for k in old[worker])
        assert sum(engine.llm.apply_model(count_conv_mixers)) > 0
