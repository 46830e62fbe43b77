"""The collective weight sync's pure parts: the bucket layout, flatten/unflatten, the config; and the
gloo group's timeout (two groups in one process, one side never joining or never sending)."""

from __future__ import annotations

import threading

import pytest
import torch

from rlcheck.engines.vllm_collective import (
    ALIGN_BYTES,
    BucketLayout,
    SyncGroup,
    flatten,
    layer_key,
    plan_buckets,
    receive_buckets,
    send_weights,
    specs_of,
    unflatten,
)
from rlcheck.errors import ConfigError, WeightSyncError
from rlcheck.loop.weight_sync import WeightSyncConfig


def _weights(num_layers: int = 3, hidden: int = 8):
    g = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(32, hidden, generator=g))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", torch.randn(hidden, hidden, generator=g)),
                (p + "self_attn.k_proj.weight", torch.randn(hidden // 2, hidden, generator=g).bfloat16()),
                (p + "mlp.up_proj.weight", torch.randn(3 * hidden, hidden, generator=g)),
                (p + "input_layernorm.weight", torch.randn(hidden, generator=g).half())]
    return out + [("model.norm.weight", torch.randn(hidden, generator=g)), ("lm_head.weight", torch.randn(32, hidden, generator=g))]


class TestPlanBuckets:
    def test_layers_are_never_split_and_buckets_stay_under_the_size(self):
        """Each decoder layer lies in one bucket; buckets hold several layers up to the size."""
        w = _weights()
        layer_bytes = sum(t.numel() * t.element_size() + ALIGN_BYTES for n, t in w if n.startswith("model.layers.0."))
        layout = plan_buckets(specs_of(w), bucket_bytes=2 * layer_bytes)
        assert layout.names == [n for n, _ in w]  # sending order kept
        for bucket in layout.buckets:
            keys = [layer_key(s.name) for s in bucket]
            assert all(sum(1 for b in layout.buckets if any(layer_key(s.name) == k for s in b)) == 1 for k in keys)
        assert all(layout.bucket_bytes(i) <= 2 * layer_bytes for i in range(len(layout.buckets)))
        assert 1 < len(layout.buckets) < len(w)
        assert all(s.offset % ALIGN_BYTES == 0 for b in layout.buckets for s in b)

    def test_a_layer_larger_than_the_bucket_goes_alone(self):
        """With a 1-byte bucket size every layer (and each top-level module) gets a bucket of its own."""
        layout = plan_buckets(specs_of(_weights(num_layers=2)), bucket_bytes=1)
        assert [sorted({layer_key(s.name) for s in b}) for b in layout.buckets] == [
            ["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.norm"], ["lm_head"]]

    def test_layer_key(self):
        """The decoder layer when the name has an index, else the module."""
        assert layer_key("model.layers.12.mlp.experts.3.up_proj.weight") == "model.layers.12"
        assert layer_key("model.embed_tokens.weight") == "model.embed_tokens"
        assert layer_key("lm_head.weight") == "lm_head"

    def test_layout_round_trips_through_json(self):
        layout = plan_buckets(specs_of(_weights()), bucket_bytes=4096)
        assert BucketLayout.from_json(layout.to_json()) == layout


class TestFlatten:
    def test_round_trip_is_bit_exact_across_dtypes(self):
        """flatten then unflatten gives every tensor back, bit for bit, shape and dtype kept."""
        w = _weights()
        layout = plan_buckets(specs_of(w), bucket_bytes=3000)
        by_name = dict(w)
        buf = torch.empty(max(layout.bucket_bytes(i) for i in range(len(layout.buckets))), dtype=torch.uint8)
        got = {}
        for slots in layout.buckets:
            flat = flatten(slots, [by_name[s.name] for s in slots], buf).clone()  # the wire copy
            got.update((n, t.clone()) for n, t in unflatten(slots, flat))
        assert list(got) == list(by_name)
        for name, t in w:
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8))
        assert layout.num_bytes == sum(t.numel() * t.element_size() for _, t in w)


class TestWeightSyncConfig:
    def test_defaults_and_validation(self):
        assert WeightSyncConfig().method == "object-store"
        assert WeightSyncConfig("collective", bucket_mb=1).bucket_bytes == 2**20
        with pytest.raises(ConfigError, match="one of"):
            WeightSyncConfig("nccl")
        with pytest.raises(ConfigError, match="bucket_mb"):
            WeightSyncConfig("collective", bucket_mb=0)
        with pytest.raises(ConfigError, match="backend must be one of"):
            WeightSyncConfig("collective", backend="mpi")

    def test_backend_follows_the_trainer_device(self):
        """"auto" is NCCL for a CUDA trainer, gloo otherwise; a named backend is kept."""
        auto = WeightSyncConfig("collective")
        assert [auto.group_backend(d) for d in ("cpu", "cuda", "cuda:1")] == ["gloo", "nccl", "nccl"]
        assert WeightSyncConfig("collective", backend="gloo").group_backend("cuda") == "gloo"

    @pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
    def test_nccl_without_cuda_is_refused_before_any_rendezvous(self):
        with pytest.raises(ConfigError, match="'nccl' needs CUDA.*backend='gloo'"):
            SyncGroup("127.0.0.1", _free_port(), 0, 2, timeout_s=1.0, backend="nccl")


class TestSendReceive:
    def test_weights_arrive_bit_exact_in_their_buckets(self):
        """Rank 0's `send_weights` and an engine's `receive_buckets` over a real gloo group (two
        threads): every tensor arrives bit for bit, in buckets that keep layers whole."""
        port, weights, groups = _free_port(), _weights(), {}
        sender = threading.Thread(target=lambda: groups.setdefault(0, SyncGroup("127.0.0.1", port, 0, 2, 30.0)))
        sender.start()
        groups[1] = SyncGroup("127.0.0.1", port, 1, 2, 30.0)
        sender.join()
        sent = {}
        sender = threading.Thread(target=lambda: sent.update(send_weights(groups[0], weights, 2048)))
        sender.start()
        stats, got, bucket_of = {}, {}, {}
        for i, bucket in enumerate(receive_buckets(groups[1], stats)):
            got.update((n, t.clone()) for n, t in bucket)
            for n, _ in bucket:
                bucket_of.setdefault(layer_key(n), set()).add(i)
        sender.join()
        assert all(len(b) == 1 for b in bucket_of.values())
        assert groups[1].device.type == "cpu" and sent["buckets"] == stats["buckets"] > 1
        assert got.keys() == dict(weights).keys()
        assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in weights)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
class TestSyncGroupTimeout:
    def test_a_peer_that_never_joins_raises(self):
        """Rank 0 alone: WeightSyncError after the timeout, not a hang."""
        with pytest.raises(WeightSyncError, match="did not take part within 1 s"):
            SyncGroup("127.0.0.1", _free_port(), 0, 2, timeout_s=1.0)

    def test_a_peer_that_joins_but_never_sends_raises(self):
        """Both join; rank 1 waits for a broadcast rank 0 never makes: WeightSyncError at the timeout."""
        port, groups = _free_port(), {}
        joiner = threading.Thread(target=lambda: groups.setdefault(0, SyncGroup("127.0.0.1", port, 0, 2, 2.0)))
        joiner.start()
        groups[1] = SyncGroup("127.0.0.1", port, 1, 2, 2.0)
        joiner.join()
        with pytest.raises(WeightSyncError, match="receiving bucket 0"):
            groups[1].broadcast(torch.zeros(4), "receiving bucket 0")


class TestTensorParallelBackend:
    def test_nccl_with_tensor_parallel_workers_is_refused_at_config(self, tiny_model):
        """A collective NCCL sync into a TP=2 engine is refused when the LoopConfig is built, naming the
        setting and the ways that work; gloo and the object store are kept; TP=1 NCCL too."""
        from dataclasses import replace

        from rlcheck.loop.presets import tiny_cpu
        from rlcheck.loop.weight_sync import WeightSyncConfig

        cfg = tiny_cpu(tiny_model("llama"), trainer="hf")
        tp2 = replace(cfg.rollout, tensor_parallel_size=2)
        with pytest.raises(ConfigError, match="'nccl' with tensor_parallel_size=2.*backend='gloo'.*object-store"):
            replace(cfg, rollout=tp2, weight_sync=WeightSyncConfig("collective", backend="nccl"))
        for ok in (WeightSyncConfig("collective", backend="gloo"), WeightSyncConfig("object-store")):
            assert replace(cfg, rollout=tp2, weight_sync=ok).weight_sync == ok
        assert replace(cfg, weight_sync=WeightSyncConfig("collective", backend="nccl")).rollout.tensor_parallel_size == 1
