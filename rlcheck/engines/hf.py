"""The independent reference: Hugging Face Transformers' own forward pass, scoring given tokens.

    scorer = HFScorer(HFScorerConfig(model="models/hybrid"))
    logps = scorer.score(prompts, responses, temperature=1.0)   # list of (len(response),) float32

It is deliberately plain: the model's logits, log_softmax(logits / T), gathered at each response
token (prompt + previous response tokens as context). Nothing of vLLM and nothing of rlcheck's own
`logprobs` module is involved, so it can judge both.

Batching with little padding waste:
- length buckets (the default on CPU, and always for models with recurrent layers: Mamba2, the
  GraniteMoeHybrid hybrid, whose HF path cannot reset state inside a row): sequences sorted by length
  and batched with right padding up to the longest of similar lengths (no batch takes a sequence
  shorter than MIN_FILL of its longest; right padding never reaches a real token: attention is causal
  and the state flows forward). `last_padding_fraction` reports the waste.
- packed rows (attention-only models on CUDA, or `pack=True`): sequences back to back in rows of up
  to `max_row_tokens` tokens, position ids restarting at 0 for each; transformers turns that into a
  block-diagonal causal mask, so no sequence sees another and no token is padding.
Each way is checked against scoring one sequence at a time (`score_one`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core.model_types import is_recurrent
from rlcheck.errors import ConfigError, InputError

MIN_FILL = 0.85
"""A padded batch takes no sequence shorter than this fraction of its longest (which comes first)."""


@dataclass(frozen=True)
class HFScorerConfig:
    model: str
    """Local model directory (HF layout)."""
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_tokens: int = 8192
    """Tokens per forward pass of padded batches (batch x padded length)."""
    max_row_tokens: int = 1024
    """Tokens per packed row: its block-diagonal mask is dense, so its cost grows with length^2."""
    pack: bool | None = None
    """Pack attention models into rows (no padding). None: only on CUDA. On CPU the packed row's dense
    block-diagonal mask costs more than the padding it saves (BENCHMARKS.md, replay throughput), so
    sequences of similar length are right-padded into batches instead. Mamba models never pack."""
    attn_implementation: str | None = None
    """None lets transformers choose (sdpa where the model supports it)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_batch_tokens < 1 or self.max_row_tokens < 1:
            raise ConfigError("max_batch_tokens and max_row_tokens must be >= 1")


class HFScorer:
    """See the module docstring."""

    def __init__(self, cfg: HFScorerConfig, model: Any = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.torch = torch
        extra = {} if cfg.attn_implementation is None else {"attn_implementation": cfg.attn_implementation}
        self.model = model or AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype), **extra)
        self.model.to(cfg.device).eval()
        pack = cfg.pack if cfg.pack is not None else str(cfg.device).startswith("cuda")
        self.packed = pack and not is_recurrent(self.model.config)
        self.last_padding_fraction = 0.0

    # ---- public --------------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        progress: Callable[[int], None] | None = None,
    ) -> list[np.ndarray]:
        """Logprob of every response token, per sequence, batched (packed or length-bucketed).
        `progress(num_tokens)` is called after each forward pass with the tokens it scored."""
        seqs = _sequences(prompts, responses, temperature)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        out: list[np.ndarray | None] = [None] * len(seqs)
        real = total = 0
        budget = self.cfg.max_row_tokens if self.packed else self.cfg.max_batch_tokens
        for group in _groups(order, [len(seqs[i][0]) for i in range(len(seqs))], budget, self.packed):
            lens = [len(seqs[i][0]) for i in group]
            real += sum(lens)
            total += sum(lens) if self.packed else len(group) * max(lens)
            for i, lp in zip(group, self._score_group([seqs[i] for i in group], temperature), strict=True):
                out[i] = lp
            if progress is not None:
                progress(sum(lens))
        self.last_padding_fraction = 1.0 - real / total if total else 0.0
        return out  # type: ignore[return-value]

    def score_one(self, prompt: Sequence[int], response: Sequence[int], *, temperature: float = 1.0) -> np.ndarray:
        """One sequence alone: the yardstick for the batched paths."""
        (seq,) = _sequences([prompt], [response], temperature)
        return self._score_padded([seq], temperature)[0]

    # ---- forward passes ------------------------------------------------------------------------

    def _score_group(self, seqs: list[tuple[list[int], int]], temperature: float) -> list[np.ndarray]:
        if self.packed and len(seqs) > 1:
            return self._score_packed(seqs, temperature)
        return self._score_padded(seqs, temperature)

    def _score_packed(self, seqs: list[tuple[list[int], int]], temperature: float) -> list[np.ndarray]:
        torch = self.torch
        ids = torch.tensor([t for s, _ in seqs for t in s], dtype=torch.long, device=self.cfg.device)[None]  # (1, T)
        pos = torch.cat([torch.arange(len(s)) for s, _ in seqs])[None].to(self.cfg.device)  # (1, T)
        with torch.no_grad():  # no cache: only then does transformers read position_ids as packing
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # (T, V)
        out, start = [], 0
        for s, prompt_len in seqs:
            out.append(self._gather(logits[start : start + len(s)], s, prompt_len, temperature))
            start += len(s)
        return out

    def _score_padded(self, seqs: list[tuple[list[int], int]], temperature: float) -> list[np.ndarray]:
        torch = self.torch
        ids = right_padded([s for s, _ in seqs], self.model.config.pad_token_id or 0)  # (B, T)
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.cfg.device), use_cache=False).logits  # (B, T, V)
        return [self._gather(logits[b, : len(s)], s, p, temperature) for b, (s, p) in enumerate(seqs)]

    def _gather(self, logits, seq: list[int], prompt_len: int, temperature: float) -> np.ndarray:
        """log_softmax(logits / T) at positions prompt_len-1 .. L-2, gathered at the next token."""
        torch = self.torch
        rows = logits[prompt_len - 1 : len(seq) - 1].float() / temperature  # (R, V)
        targets = torch.tensor(seq[prompt_len:], dtype=torch.long, device=rows.device)  # (R,)
        logp = torch.log_softmax(rows, dim=-1).gather(-1, targets[:, None])[:, 0]
        return logp.cpu().numpy().astype(np.float32)


def right_padded(rows: Sequence[Sequence[int]], pad_id: int):
    """(B, T) int64 tensor of the token rows, right-padded with `pad_id` to the longest. Right padding
    never reaches a real token of a causal model (attention is causal, recurrent state flows forward)."""
    import torch

    ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids


def _sequences(prompts, responses, temperature: float) -> list[tuple[list[int], int]]:
    if len(prompts) != len(responses):
        raise InputError(f"{len(prompts)} prompts for {len(responses)} responses")
    if not temperature > 0:
        raise InputError(f"temperature must be > 0, got {temperature}")
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) == 0:
            raise InputError(f"sequence {i}: the prompt is empty (the first response token needs context)")
        out.append(([int(t) for t in p] + [int(t) for t in r], len(p)))
    return out


def _groups(order: list[int], lens: list[int], budget: int, packed: bool) -> list[list[int]]:
    """Consecutive runs of `order` (longest first) that fit `budget` tokens per forward pass."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        cost = lens[i] if packed else max([lens[j] for j in current] + [lens[i]]) * (len(current) + 1)
        too_short = not packed and current and lens[i] < MIN_FILL * lens[current[0]]  # padding > 1 - MIN_FILL
        if current and ((used + lens[i] if packed else cost) > budget or too_short):
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += lens[i]
    if current:
        groups.append(current)
    return groups
