"""Preflight: before a run, compare what the engine and the trainer will do, and list every setting
that would make their logprobs differ, each with its fix (`rlcheck preflight`, docs/preflight.md).

    from rlcheck.preflight import PreflightConfig, run_static, run_preflight, render
    result = run_static(PreflightConfig(model="models/a", engine_model="models/b"))   # configs, tokenizers, sampling
    result = run_preflight(PreflightConfig(model="models/a"))                           # + the vLLM vs HF probe
    print(render(result)); result.differs; [f.key for f in result.findings]

- `config`: `PreflightConfig` (the sides' settings); `findings`: `Finding`, `Preflight`, severities;
- `sides`: what each side loads (config.json, generation_config.json, tokenizer);
- `models`, `tokens`, `static`: the pure checks; `dynamic`: the probe (vLLM, transformers);
- `render`: text; `attach`: the adapters' attach-time check (a warning block, critical findings refused).
The static part imports no torch, vLLM or transformers until a tokenizer is loaded.
"""

from rlcheck.preflight.attach import as_context, attach_check
from rlcheck.preflight.config import PreflightConfig
from rlcheck.preflight.findings import SEVERITIES, Finding, Preflight
from rlcheck.preflight.render import render
from rlcheck.preflight.sides import Side, load_side, side_of_model
from rlcheck.preflight.static import run_static


def run_preflight(cfg: PreflightConfig, *, probe: bool | None = None, engine=None) -> Preflight:
    """The static checks and the probe (`rlcheck.preflight.dynamic.run_preflight`)."""
    from rlcheck.preflight.dynamic import run_preflight as run

    return run(cfg, probe=probe, engine=engine)


__all__ = ["SEVERITIES", "Finding", "Preflight", "PreflightConfig", "Side", "as_context", "attach_check",
           "load_side", "render", "run_preflight", "run_static", "side_of_model"]
