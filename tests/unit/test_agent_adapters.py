"""The agent frameworks' trajectories as multi-turn batches (`rlcheck.integrations.agents`).

OpenRLHF and verifiers install (without their trainers' stacks) in a scratch venv that sees this one's
packages (/work/venvs/i39-fw, BENCHMARKS.md "Multi-turn rollouts"): there the `test_real_*` tests run
their own objects (OpenRLHF's `MultiTurnAgentExecutor.execute` with a stub engine and a real tokenizer;
verifiers' `MessageNode`); here they skip. Every framework also has a test on a copy of the structure it
returns, as its source lays it out (cited per test): slime is not on PyPI, SkyRL needs Python 3.12.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.stats import compute
from rlcheck.core.turn_checks import check
from rlcheck.integrations import agents as A


def trainer(lr, seed=0, noise=1e-3):
    """The trainer's logprobs of a response: the engine's (0.0 on tool tokens) plus a little noise."""
    rng = np.random.default_rng(seed)
    return np.minimum(np.asarray(lr, float) + rng.normal(0, noise, len(lr)), -1e-6)


def broken(batch, version=None) -> set[str]:
    return {k for k, f in check(batch, trainer_version=version).broken.items() if f.any()}


# ---- OpenRLHF -------------------------------------------------------------------------------------

def openrlhf_copy(calls=3, prompt=(5, 6, 7)) -> dict:
    """`MultiTurnAgentExecutor.execute`'s final_response (openrlhf/utils/agent.py, OpenRLHF 0.11.2): each
    action appended to `current_obs_tokens` with its range, then the tokenized feedback; logprobs 0.0 on the
    prompt and the feedback."""
    obs, ranges, lps = list(prompt), [], [0.0] * len(prompt)
    for k in range(calls):
        action = [20 + k, 21, 1]
        ranges.append((len(obs), len(obs) + len(action)))
        obs += action
        lps += [-0.3, -0.2, -0.1]
        if k < calls - 1:
            feedback = [40, 41 + k]
            obs += feedback
            lps += [0.0] * len(feedback)
    return {"observation_tokens": obs, "action_ranges": ranges, "rollout_log_probs": lps}


def response_lps(out: dict) -> np.ndarray:
    return np.asarray(out["rollout_log_probs"][out["action_ranges"][0][0]:])


class TestOpenRLHF:
    def test_output_layout(self):
        """Turns from action_ranges, each call's prompt the tokens before it; clean; per-turn metrics logged."""
        out = openrlhf_copy()
        b = A.from_openrlhf([out], [trainer(response_lps(out))])
        assert b.turns.turn_counts(b.cu_seqlens).tolist() == [3] and b.turns.records[0].num_turns == 3
        np.testing.assert_array_equal(b.prompt_tokens[0], [5, 6, 7])
        assert broken(b) == set() and compute(b)[0][K.turn_metric("2", "tokens")] == 3

    def test_missing_logprob_filled_with_zero(self):
        """SingleTurnAgentExecutor's `else 0.0` for a missing logprob: caught as zero logprobs."""
        out = openrlhf_copy()
        a, b_ = out["action_ranges"][1]
        out["rollout_log_probs"][a:b_] = [0.0] * (b_ - a)
        lt = trainer(response_lps(openrlhf_copy()))
        assert "zero_logprobs" in broken(A.from_openrlhf([out], [lt]))

    def test_real_executor(self, tiny_model):
        """OpenRLHF's own MultiTurnAgentExecutor, a stub engine sampling fixed ids, the tiny Llama tokenizer."""
        agent = pytest.importorskip("openrlhf.utils.agent")
        import torch
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
        action = tok.encode("add 12 7", add_special_tokens=False) + [tok.eos_token_id]

        class Calculator(agent.AgentInstanceBase):
            def __init__(self):
                self.calls = 0

            async def step(self, states, **kwargs):
                self.calls += 1
                return {"rewards": torch.tensor(0.0), "environment_feedback": "\n= 19\n", "done": self.calls >= 3}

        class Engine:
            async def generate(self, prompt_ids, sampling_params, multi_modal_data=None):
                lps = [{t: SimpleNamespace(logprob=-0.25)} for t in action]
                return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(action), text="add 12 7",
                                                                finish_reason="stop", logprobs=lps)])

        out = asyncio.run(agent.MultiTurnAgentExecutor(Calculator).execute(
            "12+7=", None, SimpleNamespace(logprobs=1, max_tokens=16), 200, tok, Engine()))
        b = A.from_openrlhf([out], [trainer(response_lps(out))])
        assert b.turns.turn_counts(b.cu_seqlens).tolist() == [3] and broken(b) == set()


# ---- slime ----------------------------------------------------------------------------------------

@dataclass
class SlimeSample:
    """The fields of slime's `Sample` the converter reads (THUDM/slime slime/utils/types.py): `tokens` is
    prompt + response, `loss_mask` and `rollout_log_probs` cover the response, `weight_versions` gets one
    entry per engine call (`update_from_meta_info`)."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    group_index: int | None = 0
    index: int | None = 0


def slime_sample(versions=("7", "7")) -> SlimeSample:
    mask = [1, 1, 1, 0, 0, 1, 1]
    return SlimeSample(tokens=[9, 9, 1, 2, 3, 50, 51, 4, 5], response_length=7, loss_mask=mask,
                       rollout_log_probs=[-0.2 if m else 0.0 for m in mask], weight_versions=list(versions))


class TestSlime:
    def test_turns_and_versions(self):
        """Turns from loss_mask runs; one weight version per call becomes each turn's version."""
        s = slime_sample()
        b = A.from_slime([s], [trainer(s.rollout_log_probs)])
        assert b.turns.source == "mask_runs" and b.turns.records[0].versions == (7, 7)
        assert broken(b, version=7) == set() and b.request_ids == ("slime-0-0",)

    def test_stale_turn(self):
        """A call served by older weights (slime #1781): that turn is stale, the others kept."""
        s = slime_sample(("5", "7"))
        assert broken(A.from_slime([s], [trainer(s.rollout_log_probs)]), version=7) == {"stale_turn"}

    def test_partial_rollout_versions_stay_per_trajectory(self):
        """More calls than turns (a partial rollout resumed): the oldest version is the sequence's."""
        s = slime_sample(("5", "6", "7"))
        b = A.from_slime([s], [trainer(s.rollout_log_probs)])
        assert b.turns.records[0].versions is None and b.weight_version.tolist() == [5]


# ---- SkyRL ----------------------------------------------------------------------------------------

@dataclass
class TurnOutput:
    """The fields of SkyRL's `TurnOutput` (NovaSky-AI/SkyRL skyrl_train/generators/skyrl_gym_generator.py):
    an `added_eos` is an EOS the generator appended after a stop string, with a dummy 0.0 logprob, loss
    mask 0 (`get_turn_loss_mask`)."""

    output_ids: list[int]
    output_logprobs: list[float] | None
    obs_ids: list[int]
    added_eos: bool = False


EOS = 1


def skyrl_turns(added_eos: bool = True) -> list[TurnOutput]:
    t0 = TurnOutput([20, 21, EOS] if added_eos else [20, 21], [-0.2, -0.3, 0.0] if added_eos else [-0.2, -0.3],
                    [40, 41], added_eos)
    return [t0, TurnOutput([22, EOS], [-0.4, -0.1], [])]


class TestSkyRL:
    def test_added_eos_is_not_the_models(self):
        """The appended EOS joins the observation (mask 0): turns clean, the trained layout SkyRL's."""
        b = A.from_skyrl([[9, 9]], [skyrl_turns()], [trainer([-0.2, -0.3, 0, 0, 0, -0.4, -0.1])])
        np.testing.assert_array_equal(b.tokens, [20, 21, EOS, 40, 41, 22, EOS])
        np.testing.assert_array_equal(b.mask, [1, 1, 0, 0, 0, 1, 1])
        assert broken(b) == set()
        np.testing.assert_array_equal(b.turns.records[0].prompt_ids[1], [9, 9, 20, 21, EOS, 40, 41])

    def test_added_eos_in_the_loss_is_caught(self):
        """A converter that keeps the added EOS as the model's (its 0.0 compared): a join token in the loss."""
        turns = skyrl_turns()
        turns[0] = dataclasses.replace(turns[0], added_eos=False)  # the EOS taken for sampled
        b = A.from_skyrl([[9, 9]], [turns], [trainer([-0.2, -0.3, -0.05, 0, 0, -0.4, -0.1])])
        assert "zero_logprobs" in broken(b)


# ---- verifiers ------------------------------------------------------------------------------------

def node(token_ids, mask=None, logprobs=None, sampled=False) -> dict:
    """A v1 `MessageNode`'s token fields (verifiers/v1/graph.py, verifiers 0.4.0): the tokens it adds,
    which of them were sampled (`mask`), their logprobs; an assistant node holds the generation prompt
    (mask False) then its completion."""
    n = len(token_ids)
    return {"token_ids": list(token_ids), "mask": list(mask or [False] * n), "logprobs": list(logprobs or [0.0] * n),
            "sampled": sampled}


def branch() -> list[dict]:
    return [node([0, 3, 7, 8]),  # system + user
            node([4, 20, 21, 1], [False, True, True, True], [0.0, -0.2, -0.3, -0.1], True),  # header + completion
            node([3, 40, 41]),  # tool reply
            node([4, 22, 1], [False, True, True], [0.0, -0.4, -0.1], True)]


class TestVerifiers:
    def test_branch_turns(self):
        """Each sampled node a turn; each call's prompt every token before its completion; clean."""
        b = A.from_verifiers([branch()], [trainer([-0.2, -0.3, -0.1, 0, 0, 0, 0, -0.4, -0.1])])
        assert b.turns.turn_counts(b.cu_seqlens).tolist() == [2] and broken(b) == set()
        np.testing.assert_array_equal(b.turns.records[0].prompt_ids[1], [0, 3, 7, 8, 4, 20, 21, 1, 3, 40, 41, 4])

    def test_real_message_nodes(self):
        """verifiers' own MessageNode objects."""
        graph = pytest.importorskip("verifiers.v1.graph")
        from verifiers.v1.types import AssistantMessage, ToolMessage, UserMessage

        messages = [UserMessage(content="12+7="), AssistantMessage(content="add 12 7"),
                    ToolMessage(content="= 19", tool_call_id="c0"), AssistantMessage(content="19")]
        nodes = [graph.MessageNode(message=m, **{k: v for k, v in n.items()}) for m, n in zip(messages, branch(),
                                                                                              strict=True)]
        b = A.from_verifiers([nodes], [trainer([-0.2, -0.3, -0.1, 0, 0, 0, 0, -0.4, -0.1])])
        assert b.turns.turn_counts(b.cu_seqlens).tolist() == [2] and broken(b) == set()
