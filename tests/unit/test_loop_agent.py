"""The multi-turn calculator task without an engine: its environment, the tool's suffix ids, the episodes
a scripted engine yields under each `TurnPlan`, and what the trainer scores of them (rlcheck.loop.agent)."""

from __future__ import annotations

import numpy as np
import pytest

from rlcheck.engines.vllm import Rollout
from rlcheck.errors import ConfigError
from rlcheck.faults import parse_inject
from rlcheck.faults.turn_plan import TurnPlan
from rlcheck.loop.agent.calculator import CalculatorEnv, CalculatorTask
from rlcheck.loop.agent.episodes import EpisodeRunner
from rlcheck.loop.agent.view import episode_mask, episode_view, lay
from rlcheck.modelzoo.calculator import CHAT_TEMPLATE, install_templates, solution, tool_suffix_ids

LP = -0.25


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    folder = tiny_model("llama")
    install_templates(folder)
    return AutoTokenizer.from_pretrained(folder)


def ideal_turn(tok, prompt_ids, dropout: bool = False) -> list[int]:
    """The turn the trained model writes for this prompt: the next pair's thought and call, or the answer."""
    text = tok.decode(prompt_ids, skip_special_tokens=True)
    user, *rest = [line for line in text.split("\n") if line.strip()]
    replies = [line for line in rest if line.isdigit()]
    numbers = [int(x) for x in user.split("+")]
    total = int(replies[-1]) if replies else numbers[0]
    done = len(replies) + 1
    if done < len(numbers):
        body = f"<think>{total}+{numbers[done]}</think>add(a={total}, b={numbers[done]})"
    else:
        body = f"<think>{total}</think>{total}"
    ids = tok.encode(body, add_special_tokens=False)
    if dropout:  # "add" sampled as "a" + "dd": not the canonical tokenization of its text
        ad, d = tok.convert_tokens_to_ids(["ad", "d"])
        a, dd = tok.convert_tokens_to_ids(["a", "dd"])
        for i in range(len(ids) - 1):
            if ids[i] == ad and ids[i + 1] == d:
                ids[i:i + 2] = [a, dd]
                break
    return ids + [tok.eos_token_id]


class ScriptedEngine:
    """Answers every prompt with `ideal_turn`, logprob LP per token, and records the calls."""

    def __init__(self, tok, dropout: bool = False):
        self.tok, self.dropout, self.calls, self.version = tok, dropout, [], 0

    def __call__(self, prompts, n, seeds):
        self.calls.append((len(prompts), n, seeds))
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                ids = tuple(ideal_turn(self.tok, list(p), self.dropout))
                out.append(Rollout(request_id=f"e/s0/{len(self.calls)}-{i}-{j}", vllm_request_id=f"{i}", prompt_index=i,
                                   sample_index=j, prompt_token_ids=tuple(p), token_ids=ids,
                                   logprobs=np.full(len(ids), LP, dtype=np.float32), top_logprobs=None, text="",
                                   finish_reason="stop", weight_version=self.version, step=0))
        return out


def run(tok, plan=TurnPlan(), dropout=False, group=2, before=lambda turn: None):
    task = CalculatorTask(num_prompts=2, seed=3)
    items = task.prompts(0)
    prompts = [[tok.bos_token_id] + tok.encode(text, add_special_tokens=False) for text, _ in items]
    engine = ScriptedEngine(tok, dropout)
    episodes = EpisodeRunner(task, tok, engine, seed=0).run(items, prompts, 0, group, plan, before)
    return task, items, engine, episodes


class TestCalculatorEnv:
    def test_a_call_is_run_and_an_answer_ends(self):
        """A turn with a call gets the sum back; a turn without one is the answer, rewarded with the calls' credit."""
        env = CalculatorEnv(answer=24, calls_needed=2)
        assert env.step("<think>12+7</think>add(a=12, b=7)") == "19"
        assert env.step("<think>19+5</think>add(a=19, b=5)") == "24"
        assert env.step("<think>24</think>24") is None
        assert env.answered == "24" and env.reward() == pytest.approx(1.2)

    def test_wrong_answer_and_no_answer(self):
        """A wrong answer earns less than a right one; a trajectory that never answers only its calls' credit."""
        env = CalculatorEnv(answer=24, calls_needed=2)
        env.step("add(a=1, b=2)")
        assert env.reward() == pytest.approx(0.1)
        env.step("25")
        assert 0.1 < env.reward() < 1.1

    def test_prompts_are_the_chat_template(self, tok):
        """The task's prompt text, after bos, tokenizes to the template's render of the user's turn."""
        text, answer = CalculatorTask(seed=1).prompts(0)[0]
        user = text.split("\n")[1].removesuffix("<|eos|>")
        assert sum(int(x) for x in user.split("+")) == answer
        ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
        want = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
        assert ids == list(want)


class TestTemplates:
    def test_suffix_begins_with_the_join_newline(self, tok):
        """The tool's suffix: the newline after the sampled eos, the reply as a user turn, the generation prompt."""
        ids = tool_suffix_ids(tok, "19")
        assert tok.decode(ids) == "\n<|user|>\n19<|eos|>\n<|assistant|>\n"

    def test_trl_accepts_the_template(self, tok):
        """TRL's checks for tool calling pass: the template renders calls and replies, and keeps prefixes."""
        chat = pytest.importorskip("trl.chat_template_utils")
        assert chat.supports_tool_calling(tok) and chat.is_chat_template_prefix_preserving(tok)

    def test_stripping_leaves_out_earlier_reasoning(self, tok):
        """With strip_reasoning only the last assistant turn keeps its <think>."""
        text = tok.apply_chat_template(solution([1, 2, 3]), tokenize=False, strip_reasoning=True,
                                       chat_template=CHAT_TEMPLATE)
        assert text.count("<think>") == 1 and text.endswith("<think>6</think>6<|eos|>\n")


class TestEpisodes:
    def test_token_in_token_out(self, tok):
        """Healthy: each next prompt is the previous prompt + the turn's ids + the suffix; 3 turns, one call per turn."""
        task, items, engine, episodes = run(tok)
        assert len(episodes) == 4 and [c[:2] for c in engine.calls] == [(2, 2), (4, 1), (4, 1)]
        assert len(set(engine.calls[1][2])) == 4  # every trajectory its own seed
        for ep in episodes:
            assert len(ep.turns) == 3 and ep.reward == pytest.approx(1.2)
            for k in range(2):
                assert ep.turns[k + 1].prompt_ids == ep.turns[k].prompt_ids + ep.turns[k].output_ids + ep.suffixes[k]
            assert ep.turns[-1].prompt_ids + ep.turns[-1].output_ids == ep.prompt_token_ids + ep.token_ids
            mask = episode_mask(ep, TurnPlan())
            assert (ep.logprobs[mask] == LP).all() and (ep.logprobs[~mask] == 0.0).all()

    def test_text_history_matches_when_canonical(self, tok):
        """Re-rendering the decoded messages gives the same ids when every turn is the canonical tokenization."""
        _, _, _, healthy = run(tok)
        _, _, _, text = run(tok, TurnPlan(history="text"))
        assert [[t.prompt_ids for t in e.turns] for e in text] == [[t.prompt_ids for t in e.turns] for e in healthy]

    def test_retokenized_history_breaks_inside_the_turn(self, tok):
        """A non-canonical turn ("a"+"dd") re-rendered: the next prompt leaves its ids inside that turn."""
        _, _, _, episodes = run(tok, TurnPlan(history="text"), dropout=True)
        ep = episodes[0]
        t0, t1 = ep.turns[0], ep.turns[1]
        expected = t0.prompt_ids + t0.output_ids
        first = next(i for i, (a, b) in enumerate(zip(expected, t1.prompt_ids, strict=False)) if a != b)
        assert len(t0.prompt_ids) < first < len(expected)  # inside turn 0's output

    def test_stripped_history_breaks_at_the_think(self, tok):
        """A template that drops earlier reasoning: the next prompt leaves turn 0 at its first token."""
        _, _, _, episodes = run(tok, TurnPlan(history="stripped"))
        t0, t1 = episodes[0].turns[0], episodes[0].turns[1]
        expected = t0.prompt_ids + t0.output_ids
        first = next(i for i, (a, b) in enumerate(zip(expected, t1.prompt_ids, strict=False)) if a != b)
        assert first == len(t0.prompt_ids)
        assert tok.decode(t0.output_ids[:5]) == "<think>"

    def test_missing_logprobs_and_mid_episode_sync(self, tok):
        """The plan's lost turn has logprobs 0.0; `before_turn` runs before the turn the sync is moved to."""
        seen = []
        _, _, engine, episodes = run(tok, TurnPlan(missing_logprobs_turn=1, sync_before_turn=1), before=seen.append)
        assert seen == [1, 2]
        assert all((ep.turns[1].logprobs == 0.0).all() and (ep.turns[0].logprobs == LP).all() for ep in episodes)


class TestView:
    def test_healthy_view_is_the_episode(self, tok):
        """Healthy: the trainer scores the episode's own ids; the batch masks out the suffixes."""
        _, _, _, episodes = run(tok)
        view = episode_view(episodes, TurnPlan(), tok)
        assert view.seqs.responses[0] == episodes[0].token_ids and view.touched_ids(episodes) == []
        lp = [np.full(len(r), -0.3, dtype=np.float32) for r in view.seqs.responses]
        batch = view.step_batch(episodes, lp)
        assert batch.mask.sum() == sum(len(t.output_ids) for e in episodes for t in e.turns)
        assert (batch.tokens_train == batch.tokens).all()
        assert batch.turns.turn_counts(batch.cu_seqlens).tolist() == [3] * 4 and (batch.turns.tool == ~batch.mask).all()
        record = batch.turns.records[0]
        assert [len(p) for p in record.prompt_ids] == [len(t.prompt_ids) for t in episodes[0].turns]
        assert record.versions == (0, 0, 0) and record.num_turns == 3
        seqs = view.update_inputs(np.zeros(len(episodes)), lp, None, None)
        assert seqs.loss_tokens == int(batch.mask.sum())

    def test_no_generation_prompt(self, tok):
        """The trainer's turns >= 1 lack the 2-token header; each turn's ids still land on the engine's turn."""
        _, _, _, episodes = run(tok)
        view = episode_view(episodes, TurnPlan(trainer="no-generation-prompt"), tok)
        ep, side = episodes[0], view.sides[0]
        assert len(side.response) == len(ep.token_ids) - 2 * len(ep.suffixes)
        batch = view.step_batch(episodes, [np.zeros(len(r), dtype=np.float32) for r in view.seqs.responses])
        m = batch.mask
        assert (batch.tokens[m] == batch.tokens_train[m]).all()
        assert len(view.touched_ids(episodes)) == len(episodes)

    def test_stripped_trainer_side(self, tok):
        """Under stripped history the trainer's earlier turns are shorter (no reasoning), its last turn intact."""
        _, _, _, episodes = run(tok, TurnPlan(history="stripped"))
        view = episode_view(episodes, TurnPlan(history="stripped"), tok)
        ep, side = episodes[0], view.sides[0]
        assert side.segments[0] < ep.segments[0] and side.segments[-1] == ep.segments[-1]
        assert side.segments[1] == ep.segments[1]  # the suffix
        batch = view.step_batch(episodes, [np.zeros(len(r), dtype=np.float32) for r in view.seqs.responses])
        runs = batch.turns.runs(batch.cu_seqlens)
        assert runs.length[0] == side.segments[0] and batch.tokens[: side.segments[0]].tolist() == list(side.response[: side.segments[0]])
        assert tok.decode(batch.turns.records[0].output_ids[0][:5]) == "<think>"  # the engine's turn, as sampled

    def test_mask_faults(self, tok):
        """join-token-mask counts each suffix's first token in (the turns then the mask's runs, each one token
        longer, the calls' records kept); tool-tokens-in-loss the whole suffix (its tokens still tool tokens)."""
        _, _, _, episodes = run(tok)
        ep = episodes[0]
        healthy = episode_mask(ep, TurnPlan()).sum()
        assert episode_mask(ep, TurnPlan(join_in_loss=True)).sum() == healthy + len(ep.suffixes)
        assert episode_mask(ep, TurnPlan(tool_in_loss=True)).sum() == len(ep.token_ids)
        for plan, source in ((TurnPlan(join_in_loss=True), "mask_runs"), (TurnPlan(tool_in_loss=True), "explicit")):
            view = episode_view(episodes, plan, tok)
            batch = view.step_batch(episodes, [np.zeros(len(r), dtype=np.float32) for r in view.seqs.responses])
            assert batch.turns.source == source and batch.turns.turn_counts(batch.cu_seqlens)[0] == 3
            assert batch.turns.records[0].num_turns == 3
        runs = batch.turns.runs(batch.cu_seqlens)
        assert batch.mask[batch.turns.tool].all() and runs.length[0] == len(ep.turns[0].output_ids)

    def test_lay(self):
        """Parts cut or padded to the target's lengths, in order."""
        got = lay(np.arange(7), [3, 1, 3], [2, 1, 4], -1)
        assert got.tolist() == [0, 1, 3, 4, 5, 6, -1]


class TestRefusals:
    def test_turn_fault_needs_a_multi_turn_task(self, tiny_model):
        from rlcheck.loop.presets import tiny_cpu

        with pytest.raises(ConfigError, match="multi-turn"):
            tiny_cpu(tiny_model("llama"), fault=parse_inject("stale-turn"))

    def test_single_turn_input_fault_refused(self, tiny_model):
        from rlcheck.loop.presets import tiny_cpu

        with pytest.raises(ConfigError, match="retokenized-history"):
            tiny_cpu(tiny_model("llama"), task="calculator", fault=parse_inject("retokenize"))
