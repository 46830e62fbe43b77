"""The static preflight at attach time: what the TRL and verl adapters and rlcheck's own loop run before
vLLM starts.

    findings = attach_check(cfg, where="TRL, before vLLM starts")   # or (cfg, trainer_side, engine_side, where=...)

Policy: findings are advice, not refusals. Any finding ("info" included) is printed once as one
`RuntimeWarning` block (`rlcheck.preflight.render`), and the adapter records the findings in the Monitor's
context (every dump's meta.json, key "preflight"). Refused, with a `ConfigError` naming the keys and
their fixes, are only the "critical" ones: those that leave nothing to compare (the sides' token ids
mean different strings, or the engine returns logits), where the Monitor's numbers would be noise. An
"error" finding (RoPE base, raw logprobs at T != 1, ...) is certain to make the sides differ, and
that is what the Monitor then shows, with this warning as the explanation.
"""

from __future__ import annotations

import warnings

from rlcheck.errors import ConfigError
from rlcheck.preflight.config import PreflightConfig
from rlcheck.preflight.findings import Finding
from rlcheck.preflight.render import render, render_finding
from rlcheck.preflight.sides import Side
from rlcheck.preflight.static import run_static


def attach_check(cfg: PreflightConfig, trainer: Side | None = None, engine: Side | None = None, *,
                 where: str) -> tuple[Finding, ...]:
    """Run the static preflight; warn with the block when anything is found; ConfigError on a critical
    finding. Returns the findings (for the run's context)."""
    result = run_static(cfg, trainer, engine)
    critical = [f for f in result.findings if f.severity == "critical"]
    if critical:
        detail = "\n".join(line for f in critical for line in render_finding(f))
        raise ConfigError(f"rlcheck preflight ({where}): the two sides cannot be compared "
                          f"({', '.join(f.key for f in critical)}):\n{detail}")
    if result.findings:
        warnings.warn(render(result, f"rlcheck preflight ({where})"), RuntimeWarning, stacklevel=3)
    return result.findings


def as_context(findings: tuple[Finding, ...] | None) -> list[dict]:
    """The findings as the Monitor's context records them (key "preflight")."""
    return [f.to_dict() for f in findings or ()]
