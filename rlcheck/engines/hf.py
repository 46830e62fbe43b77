"""The independent reference: Hugging Face Transformers' own forward pass, scoring given tokens.

    scorer = HFScorer(HFScorerConfig(model="models/hybrid"))
    logps = scorer.score(prompts, responses, temperature=1.0)   # list of (len(response),) float32

It is deliberately plain: the model's logits, log_softmax(logits / T), gathered at each response
token (prompt + previous response tokens as context). Nothing of vLLM and nothing of rlcheck's own
`logprobs` module is involved, so it can judge both.

Only the positions compared get logits, `LOGIT_CHUNK_BYTES` of them at a time: the model's decoder
(`get_decoder()`) gives the final hidden states, and its LM head (`get_output_embeddings()`, then the
config's `logits_scaling`, `logit_scale` or `final_logit_softcapping`) turns each chunk of the response
positions into logits. (B, T, V) logits of every position, prompt included, are never built: one
32k-token sequence would be 19.9 GB of them in float32 at a 151,936 vocabulary (BENCHMARKS.md, "HF
reference memory"). The split is checked against the model's own forward on a short probe when the
scorer is built; a model whose head it does not reproduce is scored through its own forward (all
positions' logits), with a warning.

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
LOGIT_CHUNK_BYTES = 256 * 2**20
"""Float32 logits of one chunk of scored positions: 441 rows at a 151,936 vocabulary (BENCHMARKS.md,
"HF reference memory": the time per token is flat from ~64 rows up)."""


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
        if str(cfg.device) != "cpu":
            extra["device_map"] = str(cfg.device)  # weights read straight onto the GPU, not staged in host memory
        self.model = model or AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype), **extra)
        self.model.to(cfg.device).eval()
        self.split = split_head(self.model)  # (decoder, head): logits only where compared; None: the model's own
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
        states = self._states(ids, pos)[0]  # (T, H), or (T, V) logits without a split head
        out, start = [], 0
        for s, prompt_len in seqs:
            out.append(self._gather(states[start : start + len(s)], s, prompt_len, temperature))
            start += len(s)
        return out

    def _score_padded(self, seqs: list[tuple[list[int], int]], temperature: float) -> list[np.ndarray]:
        ids = right_padded([s for s, _ in seqs], self.model.config.pad_token_id or 0)  # (B, T)
        states = self._states(ids.to(self.cfg.device))  # (B, T, H), or (B, T, V) logits
        return [self._gather(states[b, : len(s)], s, p, temperature) for b, (s, p) in enumerate(seqs)]

    def _states(self, ids, positions=None):
        """The final hidden states of `ids` (B, T, H), or the model's own logits (B, T, V) when its head
        is not split off; no cache (only then does transformers read position_ids as packing)."""
        kwargs = {"input_ids": ids, "use_cache": False, **({} if positions is None else {"position_ids": positions})}
        with self.torch.no_grad():
            if self.split is None:
                return self.model(**kwargs).logits
            return self.split[0](**kwargs).last_hidden_state

    def _gather(self, states, seq: list[int], prompt_len: int, temperature: float) -> np.ndarray:
        """log_softmax(logits / T) at positions prompt_len-1 .. L-2, gathered at the next token, the
        logits made chunk by chunk from those positions' hidden states (`LOGIT_CHUNK_BYTES`)."""
        torch = self.torch
        rows = states[prompt_len - 1 : len(seq) - 1]  # (R, H) or (R, V)
        targets = torch.tensor(seq[prompt_len:], dtype=torch.long, device=rows.device)  # (R,)
        vocab = self.model.config.get_text_config().vocab_size
        chunk = max(1, LOGIT_CHUNK_BYTES // (4 * vocab))
        out = torch.empty(rows.shape[0], dtype=torch.float32)
        with torch.no_grad():
            for a in range(0, rows.shape[0], chunk):
                x = rows[a : a + chunk]
                logits = (x if self.split is None else self.split[1](x)).float() / temperature  # (c, V)
                out[a : a + chunk] = torch.log_softmax(logits, dim=-1).gather(-1, targets[a : a + chunk, None])[:, 0].cpu()
        return out.numpy()


def split_head(model: Any) -> tuple[Any, Any] | None:
    """(decoder, head) of a causal LM: the decoder's final hidden states, and head(h) = its LM head with
    the config's logit transform, in float32; None when the model has no such parts or the two do not
    give its own logits on a probe (then it is scored through its own forward)."""
    import warnings

    import torch

    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or decoder is model or lm_head is None:
        return None
    cfg = model.config.get_text_config()
    scale = (1.0 / cfg.logits_scaling if getattr(cfg, "logits_scaling", None) else 1.0) * (getattr(cfg, "logit_scale", None) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def head(hidden):  # in the head's dtype, as the models' own forwards cast (a bf16 Mamba2's norm_f is fp32)
        x = lm_head(hidden.to(lm_head.weight.dtype)).float() * scale
        return x if not cap else torch.tanh(x / cap) * cap

    device = next(model.parameters()).device
    probe = (torch.arange(1, 9, device=device) % cfg.vocab_size)[None]  # (1, 8)
    with torch.no_grad():
        want = model(input_ids=probe, use_cache=False).logits.float()
        got = head(decoder(input_ids=probe, use_cache=False).last_hidden_state)
    tol = (1e-4 if lm_head.weight.dtype == torch.float32 else 2e-2) * max(1.0, float(want.abs().max()))
    if got.shape != want.shape or not bool((got - want).abs().max() <= tol):
        warnings.warn(f"rlcheck: the HF reference cannot split {type(model).__name__}'s LM head off its decoder (the "
                      "two do not give its logits): it scores through the model's own forward, which holds every "
                      "position's logits", RuntimeWarning, stacklevel=2)
        return None
    return decoder, head


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
