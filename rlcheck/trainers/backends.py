"""How the model is wrapped, stepped and gathered: plain (one process), FSDP2 and DeepSpeed ZeRO 1-3.

Each backend owns the wrapped model and its optimizer (AdamW everywhere, so the three give the same
update), and answers four calls: `backward(loss)`, `step() -> grad norm`, `full_state_dict()` (the
unsharded weights on rank 0, None elsewhere; a collective) and `module` (what the forward calls).
Gradients are averaged over ranks by FSDP2 and DeepSpeed; the caller scales losses accordingly.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from rlcheck.engines.layers import decoder_layers
from rlcheck.trainers.config import TrainerConfig
from rlcheck.trainers.staging import Weights, host_weights


class PlainBackend:
    """One process, no wrapper."""

    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.module = self._wrap(model)
        self.optimizer = self._optimizer()

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def _optimizer(self):
        c = self.cfg
        return torch.optim.AdamW(self.module.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)

    def begin_step(self, num_micro_batches: int) -> None:
        """Called before the first backward of a step."""
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip (if configured), apply the update; returns the global gradient norm before clipping."""
        max_norm = self.cfg.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(self) -> Weights | None:
        return host_weights(self.module.state_dict(keep_vars=True).items(), _whole, keep=True)


class HFBackend(PlainBackend):
    """One process, the `hf` backend. With a bfloat16 (or float16) `cfg.dtype` the model computes in
    that dtype, exactly as the engine does, and AdamW updates float32 master copies of its parameters,
    rounded into the model after every step (as FSDP2's masters, `FSDP2Backend`): AdamW on the bf16
    parameters themselves rounds most updates away at RL learning rates (BENCHMARKS.md, "bf16 master
    weights"). Synced weights are the model's, in its dtype."""

    masters: list[torch.Tensor] | None = None

    def _optimizer(self):
        if self.cfg.dtype == "float32":
            return super()._optimizer()
        self.working = [p for p in self.module.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.working]
        c = self.cfg
        return torch.optim.AdamW(self.masters, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)

    def begin_step(self, num_micro_batches: int) -> None:
        self.module.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        if self.masters is None:
            return super().step()
        for m, p in zip(self.masters, self.working, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.max_grad_norm or math.inf)
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.working, strict=True):
                p.copy_(m)  # rounded to the model's dtype
        self.module.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


class FSDP2Backend(PlainBackend):
    """`fully_shard` on every decoder layer, then the root (embeddings, final norm, LM head).

    With a bfloat16 `cfg.dtype` the shards AdamW updates are float32 master weights, and
    `MixedPrecisionPolicy` gathers them in bfloat16 for the forward and backward (the logprobs are
    computed as a bfloat16 model computes them) and reduces gradients in float32: DeepSpeed's bf16 mode.
    AdamW on bfloat16 parameters rounds most updates away: at lr 1e-6 a step moves a weight by ~1e-6,
    under half its bf16 spacing (6e-5 at |w| = 0.02), so 10 steps change 2% of the weights, against
    99.99% in float32 (BENCHMARKS.md, "bf16 master weights"). Synced weights go out in the dtype they
    were loaded in (the engine's).
    """

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.sync_dtypes = {n: t.dtype for n, t in model.state_dict().items()}
        mp_policy = MixedPrecisionPolicy()
        if self.cfg.dtype != "float32":
            model.float()  # the master weights: the loaded values, exactly
            mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, self.cfg.dtype), reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        return model

    def full_state_dict(self) -> Weights | None:
        """Entry by entry: each shard cast to the synced dtype on its device, then gathered
        (`rlcheck.trainers.staging`); every rank takes part, rank 0 keeps the result."""
        def full(name: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach().to(self.sync_dtypes[name])
            return t.full_tensor() if hasattr(t, "full_tensor") else t

        return host_weights(self.module.state_dict(keep_vars=True).items(), full, keep=self.rank == 0)


class DeepSpeedBackend(PlainBackend):
    """`deepspeed.initialize` with ZeRO stage `cfg.zero_stage` and DeepSpeed's own torch AdamW."""

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.cfg.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        import deepspeed.ops

        if self.cfg.device == "cpu":  # else the shm comm op compiles for a minute on first use
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        c = self.cfg
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": c.max_grad_norm,
            "zero_optimization": {"stage": c.zero_stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {
                "lr": c.lr, "betas": list(c.betas), "weight_decay": c.weight_decay, "eps": 1e-8, "torch_adam": True,
            }},
            "bf16": {"enabled": c.dtype == "bfloat16"},
            "steps_per_print": 2**31 - 1,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.engine = engine
        return engine

    def _optimizer(self):
        return self.engine.optimizer

    def begin_step(self, num_micro_batches: int) -> None:
        # one optimizer step per train_step: every micro-batch but the last is accumulation
        self.engine.set_train_batch_size(num_micro_batches * self.world_size)
        self.micro_batches_left = num_micro_batches

    def backward(self, loss: torch.Tensor) -> None:
        # Say where the boundary is: DeepSpeed's own guess, (micro_steps + 1) % gas, counts micro-steps
        # since the start, so once the micro-batch count changes between steps it falls mid-step.
        self.micro_batches_left -= 1
        self.engine.set_gradient_accumulation_boundary(self.micro_batches_left == 0)
        self.engine.backward(loss, scale_wrt_gas=False)  # the caller already divides by the token count
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # only advances DeepSpeed's micro-step counter

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def full_state_dict(self) -> Weights | None:
        module = self.engine.module
        entries = zero3_state_dict(module) if self.cfg.zero_stage == 3 else module.state_dict(keep_vars=True).items()
        return host_weights(entries, _whole, keep=self.rank == 0)  # every rank takes part in every gather


def _whole(name: str, t: torch.Tensor) -> torch.Tensor:
    """An entry already whole where it lies (one process, ZeRO 1-2, a gathered ZeRO-3 parameter)."""
    return t


BACKEND_TYPES = {"hf": HFBackend, "fsdp2": FSDP2Backend, "deepspeed": DeepSpeedBackend}

GATHER_NUMEL = 2**26
"""ZeRO-3 `full_state_dict` gathers parameters in groups of at most this many elements (a larger one
alone): each rank holds one group unsharded at a time, never the whole model."""


def zero3_state_dict(module: torch.nn.Module, max_numel: int = GATHER_NUMEL):
    """(name, tensor) for every entry of `module.state_dict(keep_vars=True)` (parameters and buffers,
    in its order; a tied parameter the same object under each name), each ZeRO-3 parameter gathered
    while it is yielded: valid until the next item, so copy it. A collective: every rank iterates it
    to the end."""
    import deepspeed

    for group in _gather_groups(list(module.state_dict(keep_vars=True).items()), max_numel):
        params = list({id(t): t for _, t in group if hasattr(t, "ds_id")}.values())  # a tied weight once
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield from group


def _gather_groups(entries: list[tuple[str, torch.Tensor]], max_numel: int):
    """Consecutive runs of `entries` whose ZeRO-3 parameters hold at most `max_numel` elements together."""
    group, numel = [], 0
    for name, t in entries:
        n = getattr(t, "ds_numel", 0)
        if group and numel + n > max_numel:
            yield group
            group, numel = [], 0
        group.append((name, t))
        numel += n
    if group:
        yield group

