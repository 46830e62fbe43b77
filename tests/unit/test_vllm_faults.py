"""The engine state faults' hook (`rlcheck.engines.vllm_faults.FaultHandle`) on a stand-in model
runner with vLLM 0.32's `_build_attention_metadata` signature: what it reads of each call, however
vLLM passes its arguments, and the refusal of a call it cannot read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlcheck.errors import UnsupportedVLLMError

pytest.importorskip("vllm")


class FakeTable:
    """One KV group's block table: `block_table.cpu` (rows of block ids) and blocks per row."""

    def __init__(self, rows: list[list[int]]):
        self.block_table = SimpleNamespace(cpu=torch.tensor(rows, dtype=torch.int32))
        self.num_blocks_per_row = [len(r) for r in rows]


class FakeRunner:
    """A model runner holding one Mamba KV group; its metadata builder takes vLLM 0.32's arguments."""

    def __init__(self):
        from vllm.v1.kv_cache_interface import MambaSpec

        spec = MambaSpec.__new__(MambaSpec)
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["m0"])])
        self.input_batch = SimpleNamespace(req_ids=[], block_table=[FakeTable([[0]])], num_reqs=0)

    def schedule(self, req_ids: list[str], blocks: list[int]) -> None:
        """A first prefill of each request in `req_ids`, in state block `blocks[i]`."""
        self.input_batch = SimpleNamespace(req_ids=list(req_ids), block_table=[FakeTable([[b] for b in blocks])],
                                           num_reqs=len(req_ids))

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, num_tokens_padded=None,
                                  num_reqs_padded=None, ubatch_slices=None, logits_indices=None,
                                  max_num_sampled_tokens=None, use_spec_decode=False, for_cudagraph_capture=False,
                                  num_scheduled_tokens=None, slot_mappings=None):
        from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadata

        blocks = [row[0] for row in self.input_batch.block_table[0].block_table.cpu.tolist()][:num_reqs]
        md = Mamba2AttentionMetadata(
            num_prefills=num_reqs, num_prefill_tokens=num_tokens, num_decodes=0, num_decode_tokens=0,
            num_reqs=num_reqs, has_initial_states_p=torch.zeros(num_reqs, dtype=torch.bool),
            query_start_loc_p=None, state_indices_tensor_p=torch.tensor(blocks, dtype=torch.int32),
            state_indices_tensor_d=None, query_start_loc_d=None, num_accepted_tokens=None, seq_lens=None)
        return {"m0": md}, None


class RenamedRunner(FakeRunner):
    """A vLLM whose builder no longer has a `num_reqs` argument."""

    def _build_attention_metadata(self, num_tokens, num_requests, max_query_len, **kwargs):
        return super()._build_attention_metadata(num_tokens, num_requests, max_query_len, **kwargs)


def handle_on(runner, fault="stale-state"):
    from rlcheck.engines.vllm_faults import FaultHandle

    return FaultHandle(runner, fault, None, 1000)


class TestFaultHandleCalls:
    def test_positional_num_reqs_is_real_work(self):
        """num_reqs passed by position (not keyword) is read: the step counts and the fault fires on the
        request that reuses a block held before."""
        runner = FakeRunner()
        handle = handle_on(runner)
        runner.schedule(["a-00000000", "b-00000000"], [1, 2])
        runner._build_attention_metadata(8, 2, 4)
        runner.schedule(["c-00000000"], [1])
        md, _ = runner._build_attention_metadata(4, 1, 4)
        assert handle.step == 2 and len(handle.events) == 3
        assert list(handle.affected_external()) == ["c"]
        assert handle.take_touched() == {"c"} and handle.take_touched() == set()  # what it touched, once
        assert bool(md["m0"].has_initial_states_p[0])  # c starts from a's state

    def test_keyword_and_dummy_runs(self):
        """Keyword calls are read the same; a dummy run (rows with no request) and a graph capture are skipped."""
        runner = FakeRunner()
        handle = handle_on(runner)
        runner.schedule(["a-00000000"], [1])
        runner._build_attention_metadata(num_tokens=4, num_reqs=1, max_query_len=4)
        runner._build_attention_metadata(4, 1, 4, for_cudagraph_capture=True)
        runner.schedule([None], [1])
        runner._build_attention_metadata(4, 1, 4)
        assert handle.step == 1

    def test_a_call_it_cannot_read_is_refused_at_the_first_real_step(self):
        """A builder whose request count the hook cannot find, called while the engine holds requests,
        raises (the fault would otherwise never fire, silently)."""
        runner = RenamedRunner()
        handle_on(runner)
        runner.schedule(["a-00000000"], [1])
        with pytest.raises(UnsupportedVLLMError, match="num_reqs"):
            runner._build_attention_metadata(4, 1, 4)
