"""Multi-turn rollouts: each trajectory a sequence of engine calls with the environment's reply between.

    runner = EpisodeRunner(task, tokenizer, generate, seed)
    episodes = runner.run(items, prompts, step, group_size, plan, before_turn)   # list[Episode]

Turn 0 samples `group_size` responses per prompt (one engine call, as the single-turn loop does);
every later turn continues each trajectory that made a tool call with one sample from its own next
prompt, with a seed of its own. The healthy next prompt is token-in/token-out, as TRL builds it
(`GRPOTrainer._tool_call_loop`): the previous prompt + the turn's sampled ids + the tool's suffix
ids (`rlcheck.loop.agent.dialogue.tool_suffix_ids`), never the text tokenised again; a fault's
`TurnPlan` may have the next prompt re-rendered from the decoded messages instead
(`rlcheck.faults.turns`). Each `Turn` keeps what the engine did: the ids it prefilled, the ids it
sampled, their logprobs and the weight version it held.

An `Episode` is a `Rollout` of the whole trajectory: its prompt is turn 0's, its response every turn's
ids with the tool's suffix ids between them (logprob 0.0 there, as TRL and verl hold them), so the
loop's trainer, monitor and dumps take it as they take a single-turn rollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcheck.engines.vllm import Rollout
from rlcheck.faults.turn_plan import TurnPlan
from rlcheck.loop.agent.dialogue import TOOL_NAME, tool_suffix_ids

Generate = Callable[[list[list[int]], int, "list[int] | None"], list[Rollout]]
"""(prompts, n, per-prompt seeds or None) -> rollouts, prompt-major: one engine call."""


@dataclass(frozen=True)
class Turn:
    """One engine call of a trajectory."""

    prompt_ids: tuple[int, ...]
    """What the engine prefilled."""
    output_ids: tuple[int, ...]
    logprobs: np.ndarray
    """(len(output_ids),) float32: the engine's logprob of each sampled id, as the episode records them
    (0.0 where a fault lost them)."""
    weight_version: int
    request_id: str
    finish_reason: str | None


@dataclass(frozen=True)
class Episode(Rollout):
    """A trajectory as one rollout (module docstring), with its turns and the environment's ids."""

    turns: tuple[Turn, ...] = ()
    suffixes: tuple[tuple[int, ...], ...] = ()
    """The environment's ids after each turn but the last (the tool's reply in the chat format)."""
    messages: tuple[dict[str, Any], ...] = ()
    """The conversation as the environment holds it (the turns parsed)."""
    reward: float = 0.0

    @property
    def segments(self) -> list[int]:
        """Lengths of the response's parts in order: turn 0, suffix 0, turn 1, ..., the last turn."""
        out: list[int] = []
        for k, turn in enumerate(self.turns):
            out.append(len(turn.output_ids))
            if k < len(self.suffixes):
                out.append(len(self.suffixes[k]))
        return out


@dataclass
class _Trajectory:
    prompt_index: int
    sample_index: int
    env: Any
    prompt: list[int]
    turns: list[Turn] = field(default_factory=list)
    suffixes: list[tuple[int, ...]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    first: Rollout | None = None
    done: bool = False


class EpisodeRunner:
    """Runs one step's trajectories against the engine (`generate`) and the task's environment."""

    def __init__(self, task: Any, tokenizer: Any, generate: Generate, seed: int = 0):
        self.task, self.tok, self.generate, self.seed = task, tokenizer, generate, seed

    def run(self, items: Sequence[tuple[str, int]], prompts: list[list[int]], step: int, group_size: int,
            plan: TurnPlan, before_turn: Callable[[int], None] = lambda turn: None) -> list[Episode]:
        """The step's episodes, prompt-major (G per prompt); `before_turn(t)` runs before turn t >= 1's call."""
        trajs: list[_Trajectory] = []
        for r in self.generate(prompts, group_size, None):
            tr = _Trajectory(r.prompt_index, r.sample_index, self.task.environment(items[r.prompt_index][1]),
                             list(r.prompt_token_ids), first=r)
            tr.messages.append({"role": "user", "content": self._user_text(r.prompt_token_ids)})
            self._take(tr, r, 0, plan)
            trajs.append(tr)
        for turn in range(1, self.task.max_turns):
            active = [tr for tr in trajs if not tr.done]
            if not active:
                break
            before_turn(turn)
            seeds = np.random.SeedSequence([self.seed, step, turn]).generate_state(len(active)).tolist()
            for tr, r in zip(active, self.generate([tr.prompt for tr in active], 1, seeds), strict=True):
                self._take(tr, r, turn, plan)
        return [self._episode(tr, step) for tr in trajs]

    def _take(self, tr: _Trajectory, r: Rollout, turn: int, plan: TurnPlan) -> None:
        """Record turn `turn` (rollout `r`), run its tool call, and set the trajectory's next prompt."""
        lp = np.zeros_like(r.logprobs) if plan.missing_logprobs_turn == turn else r.logprobs
        tr.turns.append(Turn(tuple(r.prompt_token_ids), tuple(r.token_ids), lp, r.weight_version, r.request_id,
                             r.finish_reason))
        tr.messages.append(self._parse(r.token_ids, r.prompt_token_ids))
        reply = tr.env.step(self.tok.decode(list(r.token_ids), skip_special_tokens=True))
        if reply is None or turn + 1 >= self.task.max_turns:
            tr.done = True
            return
        suffix = tuple(tool_suffix_ids(self.tok, reply))
        tr.suffixes.append(suffix)
        tr.messages.append({"role": "tool", "name": TOOL_NAME, "content": reply})
        if plan.history == "tokens":
            tr.prompt = list(r.prompt_token_ids) + list(r.token_ids) + list(suffix)
        else:  # the text path: the messages rendered again (and tokenised again)
            tr.prompt = list(self.tok.apply_chat_template(tr.messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False,
                                                          strip_reasoning=plan.history == "stripped"))

    def _parse(self, ids: Sequence[int], prefix: Sequence[int]) -> dict[str, Any]:
        """The turn as a chat message (the tokenizer's response template); its text when that fails."""
        try:
            return dict(self.tok.parse_response(list(ids), prefix=list(prefix)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return {"role": "assistant", "content": self.tok.decode(list(ids), skip_special_tokens=True)}

    def _user_text(self, prompt: Sequence[int]) -> str:
        text = self.tok.decode(list(prompt), skip_special_tokens=True)
        return text.strip()

    def _episode(self, tr: _Trajectory, step: int) -> Episode:
        first, last = tr.first, tr.turns[-1]
        ids: list[int] = []
        lps: list[np.ndarray] = []
        for k, turn in enumerate(tr.turns):
            ids += turn.output_ids
            lps.append(np.asarray(turn.logprobs, dtype=np.float32))
            if k < len(tr.suffixes):
                ids += tr.suffixes[k]
                lps.append(np.zeros(len(tr.suffixes[k]), dtype=np.float32))
        answer = tr.env.answered
        base = {f.name: getattr(first, f.name) for f in dataclasses.fields(Rollout)}
        return Episode(**{
            **base, "token_ids": tuple(ids), "logprobs": np.concatenate(lps), "top_logprobs": None, "experts": None,
            "text": answer if answer is not None else self.tok.decode(list(last.output_ids), skip_special_tokens=True),
            "finish_reason": last.finish_reason, "weight_version": last.weight_version, "step": step,
            "turns": tuple(tr.turns), "suffixes": tuple(tr.suffixes), "messages": tuple(tr.messages),
            "reward": tr.env.reward()})
