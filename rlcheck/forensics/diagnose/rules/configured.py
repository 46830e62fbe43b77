"""A mismatch the run was configured to have: the static preflight (`rlcheck.preflight`), which the loop, TRL
and verl run at attach time and record in every dump's context, found a setting on which the two sides
compute differently, and the run alarmed. The setting is the evidence no shape can give: a RoPE base set
through vLLM's `hf_overrides` puts a trained model off at every distance with no trend in the position (it
read as `engine_shift`), raw logprobs at T != 1 on 3- to 4-token responses barely correlate with the
engine's logprobs (it read as numeric noise). The rule names the cause the setting has:

- `position_dependent`: the RoPE base or scaling, a sliding window (`POSITIONAL`);
- `logit_processing`: the logprobs mode, a temperature, top-p/top-k/min-p or a penalty the trainer does not
  apply (`SAMPLING`);
- `engine_shift`: a norm epsilon, an activation, a softcap (`rlcheck.preflight.models.NUMERICS`).

Only "error" findings (certain to make the sides differ). A run without an alarm is named too, at
`QUIET_CONFIDENCE`, never healthy: the setting makes the sides differ whether or not its mismatch stands out
of the run's noise (a temperature of 1.1 on the bf16 MoE's 3-token answers, judged at the floor its trainer
measured: BENCHMARKS.md, "A floor measured on the run's model"). Ranked
(`CONFIDENCE`) over the rules that read a level or a spread (stale state from far-off rows, numeric noise,
an engine shift), under those whose shape a setting fixed from the start cannot make: a token shift, a
prompt mismatch, a stale prefix, periodic spikes or a `weights` alarm (0.9 and up)."""

from __future__ import annotations

from typing import Any

from rlcheck.core.stats import StatsConfig
from rlcheck.forensics.diagnose.evidence import Evidence
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.queries import affected_ids, alarm_steps, alarms_of
from rlcheck.preflight.models import NUMERICS, WINDOWS

POSITIONAL = ("rope_theta", "rope_scaling", *WINDOWS)
SAMPLING = ("logprobs_mode", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CAUSE_OF = {**{k: "position_dependent" for k in POSITIONAL}, **{k: "logit_processing" for k in SAMPLING},
            **{k: "engine_shift" for k in NUMERICS}}
"""preflight finding key -> the cause it makes."""
CONFIDENCE = 0.88
"""Over the level and spread rules (stale state from far-off rows 0.85, numeric noise 0.7, an engine shift 0.75),
under the shapes a setting fixed from the start cannot make (0.9 and up; the module docstring)."""
QUIET_CONFIDENCE = 0.6
"""A setting on record in a run that did not alarm: named, under any rule that read an alarm."""


def configured_difference(ev: Evidence) -> Finding | None:
    """The preflight's first "error" finding with a known cause (at `QUIET_CONFIDENCE` when the run did not alarm)."""
    found = [f for f in ev.preflight() if f.get("severity") == "error" and f.get("key") in CAUSE_OF]
    if not found:
        return None
    first, alarms = found[0], alarms_of(ev)
    steps = alarm_steps(alarms) if alarms else []
    others = [f["key"] for f in found[1:]]
    setting = (f"the run's preflight found {first['key']} differing: trainer {_value(first.get('trainer'))}, engine "
               f"{_value(first.get('engine'))}: {str(first.get('message', '')).rstrip('.')}"
               + (f" (also: {', '.join(others)})" if others else ""))
    if not steps:
        return Finding(CAUSE_OF[first["key"]], QUIET_CONFIDENCE, [
            setting, f"no alarm: the mismatch this setting makes stayed within the run's noise over "
                     f"{len(ev.records)} step(s), but it is there on every step; fix: {first.get('fix', '')}"])
    evidence = [setting, f"the run alarmed on {len(steps)} step(s), first {steps[0]}: the mismatch this setting "
                         f"makes; fix: {first.get('fix', '')}"]
    return Finding(CAUSE_OF[first["key"]], CONFIDENCE, evidence, steps,
                   affected_ids(ev, steps, StatsConfig().divergence_tau))


def _value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
