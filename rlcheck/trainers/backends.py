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

from rlcheck.errors import ConfigError
from rlcheck.trainers.config import TrainerConfig

Weights = list[tuple[str, torch.Tensor]]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM (Llama, Mamba2, GraniteMoeHybrid, ...)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__}: no decoder .layers to shard")
    return list(layers)


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
        return [(n, t.detach().cpu().clone()) for n, t in self.module.state_dict().items()]


class FSDP2Backend(PlainBackend):
    """`fully_shard` on every decoder layer, then the root (embeddings, final norm, LM head)."""

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model

    def full_state_dict(self) -> Weights | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return list(full.items()) if self.rank == 0 else None


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
        import deepspeed

        module = self.engine.module
        if self.cfg.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                full = [(n, t.detach().cpu().clone()) for n, t in module.state_dict().items()]
        else:
            full = [(n, t.detach().cpu().clone()) for n, t in module.state_dict().items()]
        return full if self.rank == 0 else None


BACKEND_TYPES = {"hf": PlainBackend, "fsdp2": FSDP2Backend, "deepspeed": DeepSpeedBackend}
