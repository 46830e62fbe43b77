"""Forensics: what happened to which request, after the fact (design.md, "Forensics").

- `replay`: a dump re-scored by the independent HF reference; requests ranked by max |d| against
  the rollout engine, first divergence position, the decoded tokens around it.
- `diagnose`: the likely cause of a mismatch, named from its shape.
- `stress`, `sweep`: greedy vLLM under memory pressure and load, every output replayed against the
  reference, failing requests with their scheduler context; one knob at a time for the shape.
- `localize`: the worst requests of a dump re-run through vLLM with hooks on every decoder layer and
  through the HF reference's hidden states: the first layer (and position) where they part.
"""

from rlcheck.forensics.replay import DEFAULT_TAU, DEFAULT_THRESHOLD, ReplayReport, replay
from rlcheck.forensics.replay.ranking import Context, ReplayRecord

__all__ = ["DEFAULT_TAU", "DEFAULT_THRESHOLD", "Context", "ReplayRecord", "ReplayReport", "replay"]
