"""What the detectors watch of a multi-turn step (`rlcheck.core.stats.turns`): its later turns and its
turns' heads against the rest of the step, so that a spike confined to turns >= 1 alarms even where turn 0
holds most of the tokens (diluted there in the step's own statistics). Silent on steps without turns.

- `TURN_Z` (`DetectorsConfig.turns`, a robust z): a spike of `rlcheck/turn/later_ratio` (the clipped mean
  |d| of turns >= 1 over turn 0's): a ratio within one step, so the step's wobble (the batch's mix, the
  floor's growth) cancels;
- the threshold detector's turn gates (`DEFAULT_RULES`): a later-turn level past the step-level gate,
  `later_ratio` > 4 and `head_body_ratio` > 8 (the turns' first tokens over the rest of those turns): ratios
  no healthy stream came near, and a persistent fault present from the first step, which no rolling
  baseline sees as a spike.
"""

from __future__ import annotations

from rlcheck.core import metrics as K
from rlcheck.core.detect.robust import RobustZConfig

TURN_Z = RobustZConfig(metrics=(K.TURN_LATER_RATIO,), window=128, warmup=32, z_threshold=12.0)
"""Set on the calibration seeds (0-2) of the synthetic multi-turn streams (BENCHMARKS.md, "Multi-turn
rollouts"): over 10,000 healthy steps a seed the largest robust z of the later-turn ratio was 4.8-5.2. The
heads' ratio is not watched for spikes: 160-odd head tokens a step make it heavy-tailed (z 8.5-9.9 on the
calibration seeds, past 12 on a held-out one); its gate (8x, in `DEFAULT_RULES`) catches a missing generation
prompt, which puts it at 100-250x."""
