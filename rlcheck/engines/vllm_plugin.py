"""rlcheck's engine faults as a vLLM general plugin: a plain vLLM script (the repro.py that `rlcheck
repro` writes) gets one without importing rlcheck.

    RLCHECK_VLLM_FAULT=stale-state python repro.py     # or index-wrap=8, perturb-layer=1, stale-buffer

vLLM loads the entry points of the group `vllm.general_plugins` (rlcheck's pyproject.toml names
`register`) in every process it starts, before it builds an engine. Without RLCHECK_VLLM_FAULT,
`register` returns at once; this module imports nothing heavy (the standard library; rlcheck's fault
spelling and vLLM itself only when a fault is asked for). With it (the `--inject` spelling of
`rlcheck demo` and `rlcheck stress`), it patches vLLM 0.32's worker classes for the life of the
process, so that every engine built there has the fault (a line on stderr says so):

- stale-state, index-wrap=B: `GPUModelRunner.initialize_kv_cache` (the CPU runner calls it through
  super) installs `rlcheck.engines.vllm_faults.FaultHandle` on the runner, once its KV cache groups
  exist: the hook `vllm_faults.inject` installs on one engine;
- perturb-layer=K: `Worker.load_model` (the CPU worker's too) scales decoder layer K's output
  projection (`rlcheck.engines.vllm_perturb.scale_output`) before vLLM profiles, compiles or warms up
  the model, so that a compiled graph holds it as well;
- stale-buffer: `GPUModelRunner.reload_weights` puts every Mamba mixer's conv_weights buffer back as
  it was before the reload (`rlcheck.engines.vllm_sync.restore_conv_buffers`).

`injected(spec)` applies the same patches for the length of a with-block only: `rlcheck repro`
builds its probe engines inside one, so that they are the engines repro.py builds.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

ENV = "RLCHECK_VLLM_FAULT"
PLUGIN_FAULTS = ("stale-state", "index-wrap", "perturb-layer", "stale-buffer")
"""The engine faults the plugin can inject (`rlcheck.faults`' engine-level ones, but moe-route-flip)."""


def register() -> None:
    """vLLM's entry point: the fault RLCHECK_VLLM_FAULT names, in every engine of this process."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
    activate(spec)
    print(f"rlcheck: {ENV}={spec}: rlcheck's injected fault is on in every vLLM engine of this process "
          "(a self-test of rlcheck, not vLLM's own behaviour)", file=sys.stderr)


def parse(spec: str) -> tuple[str, dict[str, Any]]:
    """(fault, options) of a spec, e.g. "index-wrap=8" -> ("index-wrap", {"boundary": 8}); a ConfigError
    naming the faults the plugin takes otherwise."""
    from rlcheck.errors import ConfigError
    from rlcheck.faults import parse_inject

    fault = parse_inject(spec).engine_fault()
    if fault is None or fault[0] not in PLUGIN_FAULTS:
        raise ConfigError(f"{ENV}={spec}: the vLLM plugin injects {', '.join(PLUGIN_FAULTS)} "
                          "(index-wrap=B, perturb-layer=K), not this fault")
    return fault


def spelling(fault: str, options: dict[str, Any]) -> str:
    """The RLCHECK_VLLM_FAULT value of (fault, options): ("index-wrap", {"boundary": 8}) -> "index-wrap=8"."""
    return fault + "".join(f"={v}" for v in options.values())


@contextlib.contextmanager
def injected(spec: str | None) -> Iterator[None]:
    """The fault `spec` in every engine built (and, for stale-buffer, reloaded) inside the block; None: none."""
    undo = activate(spec) if spec else (lambda: None)
    try:
        yield
    finally:
        undo()


def activate(spec: str) -> Callable[[], None]:
    """Patch vLLM's worker classes for the fault `spec` (see the module docstring); returns the undo."""
    fault, options = parse(spec)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    if fault in ("stale-state", "index-wrap"):
        return _wrap(GPUModelRunner, "initialize_kv_cache", lambda runner: _slot_fault(runner, fault, options))
    if fault == "perturb-layer":
        return _wrap(Worker, "load_model", lambda worker: _perturb(worker.model_runner, options["layer"]))
    return _wrap_reload(GPUModelRunner)


def _wrap(cls: type, name: str, after: Callable[[Any], None]) -> Callable[[], None]:
    """Replace `cls.name` by the original followed by `after(self)`; returns the undo."""
    original = cls.__dict__[name]

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        after(self)
        return out

    setattr(cls, name, patched)
    return lambda: setattr(cls, name, original)


def _slot_fault(runner: Any, fault: str, options: dict[str, Any]) -> None:
    from rlcheck.engines.vllm_faults import FaultHandle

    if getattr(runner, "_rlcheck_fault", None) is None:  # once a runner (a re-initialised cache keeps it)
        runner._rlcheck_fault = FaultHandle(runner, fault, options.get("boundary"), max_events=0)


def _perturb(runner: Any, layer: int) -> None:
    from rlcheck.engines.vllm_perturb import scale_output

    scale_output(runner.get_model(), layer)


def _wrap_reload(cls: type) -> Callable[[], None]:
    """`cls.reload_weights` that leaves every Mamba conv_weights buffer as it was before the reload."""
    from rlcheck.engines.vllm_sync import conv_buffers, restore_conv_buffers

    original = cls.__dict__["reload_weights"]

    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        old = conv_buffers(self.get_model())
        if not old:
            from rlcheck.errors import ConfigError

            raise ConfigError(f"{ENV}=stale-buffer needs a model with Mamba2 mixers (mamba2, hybrid)")
        out = original(self, *args, **kwargs)
        restore_conv_buffers(self.get_model(), old)
        return out

    cls.reload_weights = reload_weights
    return lambda: setattr(cls, "reload_weights", original)
