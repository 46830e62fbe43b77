"""`PolicyTrainer`: response-token logprobs under the current weights, and the clipped-surrogate update.

Run one per rank (all ranks call every method together: the forwards are collectives under FSDP2 and
ZeRO-3). Attention models are scored packed (one row, `cu_seqlens`, no padding); models with Mamba
layers, which HF cannot pack, are scored right-padded (padding comes after every real token, so it
never reaches one: attention is causal and the state flows forward).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlcheck.core.model_types import is_recurrent
from rlcheck.engines.hf import right_padded
from rlcheck.errors import InputError
from rlcheck.trainers.backends import BACKEND_TYPES, Weights
from rlcheck.trainers.batching import MicroBatchPlan, Sequences
from rlcheck.trainers.config import TrainerConfig
from rlcheck.trainers.logprobs import token_logprobs
from rlcheck.trainers.loss import clipped_surrogate


class PolicyTrainer:
    """See the module docstring."""

    def __init__(self, cfg: TrainerConfig, rank: int = 0, world_size: int = 1):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype)).to(cfg.device)
        self.packed = not is_recurrent(model.config)
        self.pad_id = int(model.config.pad_token_id or 0)
        self.backend = BACKEND_TYPES[cfg.backend](cfg, model, rank, world_size)
        self.steps_done = 0
        self.precision_copy: tuple | None = None  # (dtype, steps_done, module): `rlcheck.trainers.precision`

    # ---- the three calls of the loop ------------------------------------------------------------

    def logprobs(self, seqs: Sequences, plan: MicroBatchPlan, temperature: float | None = None,
                 at: str | None = None) -> dict[int, np.ndarray]:
        """This rank's share of the plan: sequence index -> float32 logprobs of its response tokens
        (at the config's temperature, or `temperature`: the sync check's probe scores at 1). `at`: a
        dtype ("bfloat16") the forward computes in, the model's own noise at an engine's precision
        (`rlcheck.trainers.precision`: the run's measured floor)."""
        from rlcheck.trainers.precision import at_precision

        with at_precision(self, at):
            return {i: s[0] for i, s in self._score_share(seqs, plan, temperature).items()}

    def topk_logprobs(self, seqs: Sequences, plan: MicroBatchPlan, top_k: int, routing: bool = False) -> dict[int, tuple]:
        """As `logprobs`, with more from the same forward: sequence index -> (logp (L,) float32,
        logprobs at `seqs.topk_ids` (L, K) float32, -inf at padding, or None without them, this
        distribution's own top-`top_k` ids (L, top_k) int64, or None if top_k is 0, and with `routing`
        the experts each MoE router picked for the response tokens (L, layers, k) int64, else None)."""
        return self._score_share(seqs, plan, None, top_k, routing)

    def _score_share(self, seqs: Sequences, plan: MicroBatchPlan, temperature: float | None, top_k: int = 0,
                     routing: bool = False):
        out: dict[int, tuple] = {}
        self.backend.module.eval()
        recorder = None
        if routing:
            from rlcheck.trainers.moe_routing import RouteRecorder

            recorder = RouteRecorder(self.backend.module)
        try:
            with torch.no_grad():
                for mb in self._my_batches(plan):
                    scored = self._scores(seqs, mb, temperature, top_k)  # also when empty (a dummy): a collective
                    experts = self._experts(seqs, mb, recorder)
                    if mb:
                        parts = _to_host(scored)
                        out.update((i, (*p, e) if routing else p) for i, p, e in zip(mb, parts, experts, strict=True))
        finally:
            if recorder is not None:
                recorder.remove()
        return out

    def _experts(self, seqs: Sequences, mb: tuple[int, ...], recorder: Any) -> list:
        """The response tokens' MoE experts of each sequence of the micro-batch just scored (None
        each without a recorder); the recorder is cleared for the next one."""
        if recorder is None:
            return [None] * len(mb)
        from rlcheck.trainers.moe_routing import response_experts

        experts = recorder.experts()
        recorder.clear()
        lengths = [len(seqs.prompts[i]) + len(seqs.responses[i]) for i in mb]
        width = None if self.packed and len(mb) > 1 else max(lengths, default=0)
        return response_experts(experts, lengths, [len(seqs.responses[i]) for i in mb], width) if mb else []

    def train_step(self, seqs: Sequences, plan: MicroBatchPlan) -> dict[str, float]:
        """One optimizer step on the clipped surrogate over all ranks' tokens. The loss is the mean over
        every response token of the step, or over the tokens `seqs.weights` keeps, weighted by them
        (each rank divides its sum by the global count; the backends average gradients over ranks,
        so the sum is scaled back by the world size)."""
        if seqs.advantages is None or seqs.old_logp is None:
            raise InputError("train_step needs Sequences with advantages and old_logp")
        c, batches = self.cfg, self._my_batches(plan)
        scale = self.world_size / max(seqs.num_loss_tokens, 1)
        loss_sum = clipped = 0.0
        ratio_max = 0.0
        self.backend.module.train()
        self.backend.begin_step(len(batches))
        for mb in batches:
            logps = self._forward(seqs, mb)
            if not mb:  # keep the collectives in step: a dummy forward with no weight
                self.backend.backward(logps[0].sum() * 0.0)
                continue
            logp = torch.cat(logps)  # (T,) response tokens of the micro-batch
            old = torch.from_numpy(np.concatenate([seqs.old_logp[i] for i in mb])).to(logp)
            adv = torch.from_numpy(np.repeat(seqs.advantages[list(mb)], [len(seqs.responses[i]) for i in mb])).to(logp)
            w = None if seqs.weights is None else torch.from_numpy(np.concatenate([seqs.weights[i] for i in mb])).to(logp)
            terms = clipped_surrogate(logp, old, adv, c.clip_low, c.clip_high, w)
            self.backend.backward(terms.loss_sum * scale)
            loss_sum += float(terms.loss_sum.detach())
            clipped += float(terms.clipped)
            ratio_max = max(ratio_max, float(terms.ratio_max))
        grad_norm = self.backend.step()
        self.steps_done += 1
        return {"loss_sum": loss_sum, "clipped_tokens": clipped, "ratio_max": ratio_max, "grad_norm": grad_norm}

    def full_state_dict(self) -> Weights | None:
        """The unsharded weights as (HF name, CPU tensor) pairs on rank 0, None on the other ranks."""
        return self.backend.full_state_dict()

    def fingerprint(self, engine_dtype: str) -> dict[str, list[float]]:
        """This rank's part of the sync check's fingerprint (`rlcheck.trainers.fingerprint`), for an
        engine computing in `engine_dtype`; the driver adds the ranks' parts."""
        from rlcheck.trainers.fingerprint import module_fingerprint

        b, c = self.backend, self.cfg
        sharding = {"fsdp2": "fsdp2", "deepspeed": "zero3" if c.zero_stage == 3 else "none"}.get(c.backend, "none")
        module = b.engine.module if c.backend == "deepspeed" else b.module
        return module_fingerprint(module, getattr(torch, engine_dtype), sharding=sharding, rank=self.rank,
                                  world_size=self.world_size)

    # ---- forwards -------------------------------------------------------------------------------

    def _my_batches(self, plan: MicroBatchPlan) -> tuple[tuple[int, ...], ...]:
        if plan.world_size != self.world_size:
            raise InputError(f"plan is for {plan.world_size} ranks, this trainer group has {self.world_size}")
        return plan.ranks[self.rank]

    def _forward(self, seqs: Sequences, mb: tuple[int, ...], temperature: float | None = None) -> list[torch.Tensor]:
        """Response-token logprobs of each sequence of the micro-batch (a 2-token dummy if empty)."""
        return [parts[0] for parts in self._scores(seqs, mb, temperature)]

    def _scores(self, seqs: Sequences, mb: tuple[int, ...], temperature: float | None = None, top_k: int = 0):
        """Per sequence of the micro-batch (a 2-token dummy if empty): (logp (L,), logp at its
        `seqs.topk_ids` (L, K) or None, own top-`top_k` ids (L, top_k) or None)."""
        rows = [list(seqs.prompts[i]) + list(seqs.responses[i]) for i in mb] or [[self.pad_id, self.pad_id]]
        resp = [len(seqs.responses[i]) for i in mb] or [1]
        ids = None
        if seqs.topk_ids is not None:
            ids = [torch.from_numpy(seqs.topk_ids[i]) for i in mb] or [torch.full((1, seqs.topk_ids[0].shape[1]), -1)]
        t = self.cfg.temperature if temperature is None else temperature
        if self.packed and len(rows) > 1:
            return self._packed(rows, resp, t, ids, top_k)
        return self._padded(rows, resp, t, ids, top_k)

    def _packed(self, rows: list[list[int]], resp: list[int], temperature: float, ids, top_k: int) -> list[tuple]:
        device = self.cfg.device
        tokens = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)[None]  # (1, T)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
        cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        scored = (lens - 1).tolist()  # each sequence's L - 1 logprobs
        topk_ids = None
        if ids is not None:  # (T - num_seqs, K): each sequence's ids at its last (response) positions
            topk_ids = torch.full((sum(scored), ids[0].shape[1]), -1, dtype=torch.long)
            for end, n, x in zip(torch.cumsum(lens - 1, 0).tolist(), resp, ids, strict=True):
                topk_ids[end - n : end] = x
            topk_ids = topk_ids.to(device)
        out = token_logprobs(self.backend.module, tokens, cu_seqlens=cu.to(device), temperature=temperature,
                             top_k=top_k, topk_ids=topk_ids)
        parts = [out.logp, *(out.topk or (None, None))]
        split = [None if x is None else torch.split(x, scored) for x in parts]
        return [tuple(None if x is None else x[j][-n:] for x in split) for j, n in enumerate(resp)]

    def _padded(self, rows: list[list[int]], resp: list[int], temperature: float, ids, top_k: int) -> list[tuple]:
        tokens = right_padded(rows, self.pad_id)  # (B, W)
        spans = [slice(len(r) - n - 1, len(r) - 1) for r, n in zip(rows, resp, strict=True)]
        topk_ids = None
        if ids is not None:  # (B, W-1, K)
            topk_ids = torch.full((*tokens.shape[:1], tokens.shape[1] - 1, ids[0].shape[1]), -1, dtype=torch.long)
            for b, (span, x) in enumerate(zip(spans, ids, strict=True)):
                topk_ids[b, span] = x
            topk_ids = topk_ids.to(self.cfg.device)
        out = token_logprobs(self.backend.module, tokens.to(self.cfg.device), temperature=temperature,
                             top_k=top_k, topk_ids=topk_ids)  # (B, W-1) and (B, W-1, K)
        parts = [out.logp, *(out.topk or (None, None))]
        return [tuple(None if x is None else x[b, span] for x in parts) for b, span in enumerate(spans)]


def _to_host(scored: list[tuple]) -> list[tuple]:
    """Each sequence's parts as numpy arrays, with one device-to-host copy per kind of part for the
    whole micro-batch (not one per sequence: each is a host synchronization on a GPU)."""
    lengths = [len(parts[0]) for parts in scored]
    kinds = []
    for k in range(len(scored[0])):
        if scored[0][k] is None:
            kinds.append([None] * len(scored))
            continue
        whole = torch.cat([parts[k] for parts in scored]).cpu().numpy()
        kinds.append(np.split(whole, np.cumsum(lengths)[:-1]))
    return list(zip(*kinds, strict=True))
