"""The `stale-buffer` fault of `rlcheck stress`: one weight sync before the generation (the seeded 1%
update `rlcheck repro` syncs as well, `rlcheck.forensics.repro.standalone.weight_update`), after which
every Mamba mixer's conv_weights buffer still holds its old values (`rlcheck.engines.vllm_sync.
StaleConvBuffers`: vLLM 0.32's CPU bf16 reload case, on any CPU and dtype). The reference then scores
with the updated weights (`updated_scorer`), so every request runs on the conv weights of the load
before and is judged on those of the sync.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def stale_buffer_sync(engine: Any, model: str) -> Any:
    """The fault on a started `VLLMEngine`, then its one sync; the fault's handle (`remove()`)."""
    from rlcheck.engines.vllm_sync import keep_conv_buffers_stale
    from rlcheck.forensics.repro.case import UPDATE
    from rlcheck.forensics.repro.standalone import weight_update

    handle = keep_conv_buffers_stale(engine)
    engine.sync_weights(list(weight_update(Path(model), **UPDATE).items()), version=engine.weight_version + 1)
    return handle


def updated_scorer(scorer: Any, model: str) -> Any:
    """A copy of `scorer` (an `HFScorer`) on the weights `stale_buffer_sync` syncs."""
    from rlcheck.engines.hf import HFScorer
    from rlcheck.forensics.repro.case import UPDATE
    from rlcheck.forensics.repro.standalone import weight_update

    updated = copy.deepcopy(scorer.model)
    updated.load_state_dict(weight_update(Path(model), **UPDATE), strict=False)
    return HFScorer(scorer.cfg, model=updated)
