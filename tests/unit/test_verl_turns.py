"""verl's agent-loop rows (`rlcheck.integrations.verl.turns`) on real verl objects: trajectories merged by
verl's own Continuous Token builder (`verl.utils.tokenizer.continuous_token`, as `ToolAgentLoop` merges
each assistant output and each tool reply), padded into a real `DataProto` as `AgentLoopWorker`
lays them out (`_agent_loop_postprocess` and `_postprocess`, verl/experimental/agent_loop/agent_loop.py:
prompts left-padded, responses right-padded, `response_mask` = mask x attention, `rollout_log_probs` padded
with 0.0, `__num_turns__` = user + assistant + 1). The worker itself needs hydra and Ray (not in this venv).
"""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import MismatchHalt
from rlcheck.integrations import verl as V

ct = pytest.importorskip("verl.utils.tokenizer.continuous_token")
DataProto = pytest.importorskip("verl").DataProto
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))  # the session's tiny Llama (its chat template)


def tool_trajectory(tok, builder, num_calls: int, rng) -> dict:
    """One `ToolAgentLoop` trajectory as verl builds it: each assistant output appended as sampled (its
    engine logprobs), each tool reply merged as the suffix of two chat-template renders (mask 0, 0.0)."""
    messages = [{"role": "user", "content": "12+7+5="}]
    runtime = builder.build_initial_tokens(messages)
    prompt_len = len(runtime)
    mask, logprobs = [], []
    for k in range(num_calls):
        text = f"add {12 + k} 7"
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        merged = builder.merge_assistant_tokens(runtime, ids)
        mask, logprobs = builder.align_response_metadata(merged, mask, logprobs,
                                                         assistant_logprobs=list(-rng.exponential(0.5, len(ids))))
        runtime = merged.token_ids
        messages.append({"role": "assistant", "content": text})
        if k < num_calls - 1:
            previous = list(messages)
            messages.append({"role": "tool", "content": f"= {19 + k}"})
            merged = builder.merge_context_tokens(previous, messages, runtime)
            mask, logprobs = builder.align_response_metadata(merged, mask, logprobs)
            runtime = merged.token_ids
    return {"prompt_ids": runtime[:prompt_len], "response_ids": runtime[prompt_len:], "response_mask": mask,
            "response_logprobs": logprobs, "num_turns": (num_calls - 1) + num_calls + 1}


def agent_loop_batch(outputs: list[dict], prompt_length: int = 40, response_length: int = 96, pad: int = 2):
    """verl's `_postprocess` of padded `_agent_loop_postprocess` outputs: a real DataProto."""
    b = len(outputs)
    prompts = torch.full((b, prompt_length), pad)
    responses = torch.full((b, response_length), pad)
    attention = torch.zeros((b, prompt_length + response_length), dtype=torch.int64)
    mask = torch.zeros((b, response_length), dtype=torch.int64)
    rollout = torch.zeros((b, response_length), dtype=torch.float32)
    for i, o in enumerate(outputs):
        p, r = o["prompt_ids"], o["response_ids"][:response_length]
        prompts[i, prompt_length - len(p):] = torch.tensor(p)
        responses[i, :len(r)] = torch.tensor(r)
        attention[i, prompt_length - len(p):prompt_length + len(r)] = 1
        mask[i, :len(r)] = torch.tensor(o["response_mask"][:response_length])
        rollout[i, :len(r)] = torch.tensor(o["response_logprobs"][:response_length], dtype=torch.float32)
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": mask * attention[:, prompt_length:],
                 "attention_mask": attention, "rollout_log_probs": rollout},
        non_tensors={"__num_turns__": np.array([o["num_turns"] for o in outputs], dtype=np.int32),
                     "uid": np.array([f"u{i // 2}" for i in range(b)], dtype=object)})
    return data


def with_actor_logprobs(data, rng, noise: float = 1e-3):
    """The actor's recomputation (old_log_probs): the rollout's plus a little noise on every position."""
    lr = data.batch["rollout_log_probs"]
    old = torch.minimum(lr + torch.from_numpy(rng.normal(0, noise, tuple(lr.shape))).float(), torch.zeros(()))
    data.batch["old_log_probs"] = old
    return data


class TestAgentLoopRows:
    @pytest.fixture
    def data(self, tokenizer):
        rng = np.random.default_rng(0)
        builder = ct.ContinuousTokenBuilder(tokenizer)
        outputs = [tool_trajectory(tokenizer, builder, k, rng) for k in (3, 3, 2, 1)]
        return with_actor_logprobs(agent_loop_batch(outputs), rng)

    def test_turns_from_mask_runs_match_num_turns(self, data):
        """Each row's turns are its runs of 1 in response_mask; verl's own count agrees (num_turns // 2)."""
        b = V.to_step_batch(data)
        assert b.turns is not None and b.turns.source == "mask_runs"
        np.testing.assert_array_equal(b.turns.turn_counts(b.cu_seqlens), [3, 3, 2, 1])
        assert [r.num_turns for r in b.turns.records] == [3, 3, 2, 1]

    def test_healthy_rows_are_clean(self, data, tmp_path):
        """Healthy agent-loop rows: per-turn metrics logged, no invariant broken, no alarm."""
        with Monitor(MonitorConfig(tmp_path / "r", sinks=())) as mon:
            report = V.observe(mon, 0, data)
        assert report.alarms == [] and report.metrics[K.TURN_PER_SEQ_MEAN] == pytest.approx(9 / 4)
        assert report.metrics[K.turn_metric("2", "tokens")] > 0

    def test_tool_reply_in_the_mask_is_caught(self, data, tmp_path):
        """A tool reply left at 1 in response_mask (engine logprob 0.0, the actor's far below): the turns
        merge, fewer than verl counts, and the zero-logprob run alarms; the run halts (quarantine off)."""
        mask = data.batch["response_mask"].clone()
        row = mask[0]
        ones = torch.nonzero(row).flatten()
        gap = [j for j in range(int(ones[0]), int(ones[-1])) if row[j] == 0]
        mask[0, gap] = 1
        data.batch["response_mask"] = mask
        data.batch["old_log_probs"][0, gap] = -6.0
        with pytest.raises(MismatchHalt) as exc:
            with Monitor(MonitorConfig(tmp_path / "r", sinks=())) as mon:
                V.observe(mon, 0, data)
        signatures = {a.details.get("signature") for a in exc.value.report.alarms}
        assert {"turn_turn_count", "turn_zero_logprobs"} <= signatures

    def test_single_turn_rows_pay_nothing(self, tokenizer):
        """Rows of one model turn each (SingleTurnAgentLoop: num_turns 2): no turns attached."""
        rng = np.random.default_rng(1)
        builder = ct.ContinuousTokenBuilder(tokenizer)
        data = with_actor_logprobs(agent_loop_batch([tool_trajectory(tokenizer, builder, 1, rng)] * 2), rng)
        data.non_tensor_batch["uid"] = np.array(["a", "b"], dtype=object)
        assert V.to_step_batch(data).turns is None
