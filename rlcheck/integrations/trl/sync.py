"""TRL's vLLM weight sync, watched (which step's weights vLLM holds), optionally skipped (fault
injection), and fixed for vLLM 0.32 in colocate mode.

The fix: TRL 1.16 pushes each parameter with
`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param)])`,
which calls each parameter's `weight_loader`. Whether the engine's linear layers still have one
depends on the CPU and the dtype. On CPU, vLLM 0.32's `UnquantizedLinearMethod
.process_weights_after_loading` hands every linear layer to `dispatch_cpu_unquantized_gemm`
(vllm/model_executor/layers/utils.py) with `remove_weight=True`. When a CPU kernel takes the weight
into its own packed copy (the AMX kernel, `convert_weight_packed`, on CPUs with AMX tiles for
bf16/fp16 weights up to 1 MiB; zentorch on vLLM's Zen platform; otherwise oneDNN, `create_onednn_mm`),
the layer's `weight` is replaced by an empty `Parameter` with no `weight_loader`, and TRL's call fails
with "'Parameter' object has no attribute 'weight_loader'" at the first sync. When no kernel
takes it, vLLM falls back to `torch.nn.functional.linear` on the Parameter, which keeps its loader,
and TRL's own sync works. oneDNN builds a bf16 matmul only where it has bf16 code: AVX-512
(avx512_core and later: Intel Xeon since Skylake-SP, AMD Zen 4 and later), AVX2-VNNI-2 or AMX. On an
AVX2-only CPU (the AMD EPYC here, no AVX-512) it fails ("could not create a primitive descriptor for
the matmul primitive"; vLLM logs "Failed to create oneDNN linear, fallback to torch linear"). Measured
here on the tiny Llama: a bf16 engine keeps every loader, a float32 engine has none (oneDNN has fp32
code for AVX2), so TRL's defaults (vLLM in bf16) take TRL's own sync on this machine and the reload
on an AVX-512 one.

The replacement streams the same (name, tensor) pairs through
`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` (it restores each layer's
Parameters, loads them and runs `process_weights_after_loading` again, so the kernel packs the new
weights), then resets the prefix cache as TRL does. It is used only when needed: `method="auto"`
probes the engine's linear layers (`llm.apply_model`) and keeps TRL's own sync whenever they still
carry their weight loaders and no MoE layer has CPU-prepacked experts (TRL's `load_weights` would
write new expert weights, unpacked, into the packed storage: `vllm_sync.prepack_moe_on_reload`), and
always in server mode (the server has its own update path).
tests/integration/test_trl.py runs the fire drill on the branch this CPU takes and again with vLLM's
dispatch made to take the other one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from rlcheck.engines.vllm_sync import has_prepacked_moe, prepack_moe_on_reload, refresh_mamba_conv_weights
from rlcheck.errors import ConfigError
from rlcheck.integrations._patch import replaced

METHODS = ("auto", "reload", "trl")
BURST = 3
"""Checks' worth of credit the sync check's budget holds at most (and starts with)."""


def linear_params_lack_loader(model: Any) -> bool:
    """True when some parameter of a vLLM linear layer has no `weight_loader` (vLLM >= 0.32 after
    loading): TRL's `model.load_weights` cannot load into it. Runs inside the engine (`apply_model`)."""
    from vllm.model_executor.layers.linear import LinearBase

    return any(
        not hasattr(p, "weight_loader")
        for m in model.modules() if isinstance(m, LinearBase)
        for p in m.parameters(recurse=False)
    )


def resolve_method(vllm_generation: Any, method: str) -> str:
    """"reload" or "trl": the sync this engine needs (`method="auto"`) or the one asked for."""
    if method not in METHODS:
        raise ConfigError(f"vllm_sync must be one of {METHODS}, got {method!r}")
    if vllm_generation.mode != "colocate":
        if method == "reload":
            raise ConfigError("vllm_sync='reload' needs vllm_mode='colocate' (a server updates its own weights)")
        return "trl"
    if method != "auto":
        return method
    llm = vllm_generation.llm
    lacking, moe = (any(llm.apply_model(check)) for check in (linear_params_lack_loader, has_prepacked_moe))
    return "reload" if lacking or moe else "trl"


def reload_sync(vllm_generation: Any) -> None:
    """TRL's colocate sync with vLLM's `reload_weights` in place of `model.load_weights`."""
    vg = vllm_generation
    if vg.enable_sleep_mode:  # as TRL: map the weights' memory before writing into it
        from trl.generation.vllm_generation import empty_cache

        empty_cache()
        vg.llm.wake_up(tags=["weights"])
        vg._llm_weights_sleeping = False
    # Cloned one at a time while TRL's iterator holds the parameter gathered (ZeRO-3, FSDP) or the
    # adapter merged (PEFT): vLLM may keep a tensor until the rest of its layer arrives.
    weights = ((name, t.detach().clone()) for name, t in vg._iter_named_params())
    vg.llm.apply_model(prepack_moe_on_reload)  # vLLM 0.32 CPU MoE: prepack the experts on updates too
    vg.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    refresh_mamba_conv_weights(vg.llm)  # vLLM 0.32 CPU leaves bf16 Mamba convs stale (docs/mamba-conv-sync.md)
    vg.llm.reset_prefix_cache()


def engine_dtype(vllm_generation: Any):
    """The torch dtype the colocated engine computes in."""
    import torch

    dtype = vllm_generation.llm.llm_engine.model_config.dtype
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


@contextlib.contextmanager
def _streaming(vllm_generation: Any, spoil: str | None, fp: dict | None, clock: list[float]):
    """Within it, TRL's `_iter_named_params` (what either sync streams) passes every tensor through the
    trainer's side of the sync check (`fp`, filled as they go by, `clock[0]` its seconds: no second
    gather; None: no check) and then through the sync fault (`spoil`: `rlcheck.faults.base.spoil_sync`),
    on this instance."""
    if fp is None and not spoil:
        yield
        return
    from rlcheck.faults.base import spoil_sync
    from rlcheck.trainers.fingerprint import fingerprinting, linear_tails
    from rlcheck.trainers.logprobs import unwrap

    vg, real = vllm_generation, vllm_generation._iter_named_params
    tails = linear_tails(unwrap(vg.model)) if fp is not None else set()
    dtype = engine_dtype(vg) if fp is not None else None

    def stream():
        named = real() if fp is None else fingerprinting(real(), fp, dtype, tails, clock)
        return spoil_sync(named, spoil)

    with replaced(vg, "_iter_named_params", stream):
        yield


def _agreed(due: bool) -> bool:
    """Rank 0's decision on every process (the engine's fingerprint is a collective over vLLM's
    tensor-parallel group, and each rank's budget runs on its own clock)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return due
    box = [due]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


class WeightSync:
    """Stands in for `vllm_generation.sync_weights` (TRL calls it with no arguments before a
    generation whose step differs from the last synced one). Records `synced_step`, the trainer step
    whose weights vLLM holds (None before the first sync), and the steps whose sync `skip` left out.
    In colocate mode `check=True` runs the sync check: the weights TRL streams are fingerprinted as
    they go by, the engine's after the sync; `take(step)` hands its alarm (a failed check) and scalars
    to the step whose rollouts follow. `budget`: the checks' share of the wall time, a token bucket
    (`_due`: the first syncs are checked, then as many as the budget pays for; a check as cheap as
    the budget, every one); None: every sync. `spoil(step)`: the sync fault's spoil spec for that sync."""

    def __init__(self, vllm_generation: Any, current_step: Callable[[], int], method: str = "auto",
                 skip: Callable[[int], bool] | None = None, check: bool = True,
                 spoil: Callable[[int], str | None] | None = None, budget: float | None = None):
        self.vllm_generation = vllm_generation
        self.method = resolve_method(vllm_generation, method)
        self.current_step = current_step
        self.skip = skip
        self.synced_step: int | None = None
        self.skipped: list[int] = []
        self.check = check and vllm_generation.mode == "colocate"
        self.spoil = spoil
        self.budget = budget
        self.pending = None
        self.checked: list[int] = []  # the steps whose sync was checked
        self._clock, self._credit, self._last = 0.0, 0.0, 0.0
        self._trl_sync = vllm_generation.sync_weights
        vllm_generation.sync_weights = self

    def __call__(self) -> None:
        step = self.current_step()
        # In rlcheck's fault convention skip(s) leaves out the sync after the update of step s, i.e.
        # the one TRL does before generating the rollouts of step s + 1.
        if self.skip is not None and step > 0 and self.skip(step - 1):
            self.skipped.append(step)
            return
        spec = self.spoil(step - 1) if self.spoil is not None and step > 0 else None
        fp, clock = ({} if self.check and _agreed(self._due()) else None), [0.0]
        with _streaming(self.vllm_generation, spec, fp, clock):
            if self.method == "reload":
                reload_sync(self.vllm_generation)
            else:
                self._trl_sync()
        self.synced_step = step
        if fp is not None:
            self.pending = self._compare(step, fp, clock[0])

    def _due(self) -> bool:
        """Whether this sync is checked: one of the first `BURST` syncs, whatever they cost (a sync fault in a
        run's first steps is caught on any machine's clock: two ranks' tensor-parallel fingerprints under a
        loaded CPU once cost the second check more than the bucket held), or its cost (the last check's) fits
        what the budget has accrued (`budget` x the seconds since the last sync, up to `BURST` checks' worth,
        full at the start; the first checks' cost is drawn from it too, so the share holds over the run)."""
        now = time.perf_counter()
        if self.budget is None or not self.checked:
            self._clock = now
            return True
        self._credit = min(BURST * self._last, self._credit + self.budget * (now - self._clock))
        self._clock = now
        return len(self.checked) < BURST or self._credit >= self._last

    def _compare(self, step: int, trainer: dict, streamed_seconds: float):
        """The check of the sync just made: the engine's fingerprint against the streamed weights'
        (its cost, with the stream's fingerprinting, counted against the budget)."""
        from rlcheck.core.sync_check import compare
        from rlcheck.engines.fingerprint import fingerprint_llm

        t0 = time.perf_counter()
        engine = fingerprint_llm(self.vllm_generation.llm)
        self._last = time.perf_counter() - t0 + streamed_seconds
        if not self.checked:  # the bucket starts full
            self._credit = BURST * self._last
        self._credit -= self._last
        self.checked.append(step)
        return compare(step, engine, trainer, seconds=self._last)

    def take(self, step: int) -> tuple[list, dict[str, float]]:
        """The last sync check's alarm (if it failed) and scalars, for the step about to be observed."""
        found, self.pending = self.pending, None
        return ([], {}) if found is None else (found.alarms(step), found.metrics())

    def uninstall(self) -> None:
        """Give TRL its own `sync_weights` back."""
        if self.vllm_generation.sync_weights is self:
            self.vllm_generation.sync_weights = self._trl_sync
