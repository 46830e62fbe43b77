"""The diagnose rules that read a dump's sequences token by token (the two sides' ids, the position of
the mismatch, the rows it sits in), in the order `diagnose.RULES` runs them: `tokens` (prompt ids,
re-tokenization, the stop token), `position` (padding, position, a shared prompt prefix, a few far-off rows) and
`logits` (a temperature's sign on the likely tokens); `engine`: an engine whose output is not a
function of the request (split twins: the Mamba state faults without the guard); `turns` (the causes
only multi-turn agent loops have, from the cross-turn invariants and the per-turn statistics); and `shift`
(the engine computing otherwise from one step on, the weight versions agreeing: a level, no shape); first of
all `configured`: a setting the run's preflight found differing, when the run alarmed."""

from __future__ import annotations

from rlcheck.forensics.diagnose.rules.configured import configured_difference
from rlcheck.forensics.diagnose.rules.engine import engine_state
from rlcheck.forensics.diagnose.rules.logits import logit_processing_tokens
from rlcheck.forensics.diagnose.rules.position import (
    position_dependent,
    position_ids,
    sparse_rows,
    stale_prefix_cache,
)
from rlcheck.forensics.diagnose.rules.shift import engine_shift
from rlcheck.forensics.diagnose.rules.tokens import prompt_mismatch, retokenization, stop_token
from rlcheck.forensics.diagnose.rules.turns import multiturn

EVIDENCE_RULES = (configured_difference, prompt_mismatch, retokenization, stop_token, position_ids, position_dependent, stale_prefix_cache,
                  sparse_rows, logit_processing_tokens, engine_state, multiturn, engine_shift)
