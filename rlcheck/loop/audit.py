"""The decode-prefill audit in the loop: a sample of each step's rollouts re-scored by the rollout
engine itself, before the trainer sees them.

    LoopConfig(..., audit=DecodePrefillAudit(sample=8))     # 8 rollouts a step; a failure halts the step

Per step, `sample` rollouts (a seeded draw, all of them when fewer) go back to the rollout actor as
prompt + response, and it returns the logprobs of a fresh prefill of them (`RolloutWorker.rescore`,
`rlcheck.engines.fingerprint.score_tokens`; an engine fault injected for a self-test is suspended for
it, as the stress tool runs its audits without one, except a perturbed layer: a wrong weight is wrong
in both passes). A rollout whose decode logprobs differ from its prefill ones by more than
`threshold` is engine-only evidence of a state fault (stale or shared Mamba state): one alarm of the
step, kind "signature" (signature SIGNATURE), naming the rollouts in `details["request_ids"]` (which
the quarantine's guard rule takes out of the step), critical by default. The step's extra scalars:
AUDIT_FAILING, AUDIT_MAX, AUDIT_SEQUENCES. Prompt logprobs are untempered: the audit needs rollouts
sampled at temperature 1 without logit processing (LoopConfig refuses it otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcheck.core.limits import ENGINE_TOL, FP32_ENGINE_TOL
from rlcheck.core.stats.sequences import request_divergence
from rlcheck.core.types import SEVERITIES, Alarm
from rlcheck.errors import ConfigError

SIGNATURE = "decode_prefill"
"""`details["signature"]` of the audit's alarms."""
AUDIT_FAILING, AUDIT_MAX, AUDIT_SEQUENCES = ("audit/decode_prefill_failing", "audit/decode_prefill_max_abs_diff",
                                             "audit/decode_prefill_sequences")


@dataclass(frozen=True)
class DecodePrefillAudit:
    sample: int = 8
    """Rollouts re-scored per step (a seeded draw; every rollout when the step has fewer)."""
    threshold: float | None = None
    """Max |prefill - decode| (nats) over which a rollout fails; None: the stress tool's
    (`rlcheck.core.limits`), 1e-3 for a float32 engine and 0.5 otherwise (a float32 engine's decode and prefill agree to ~1e-5, a bfloat16
    one's to ~0.1-0.2, a stale or shared state is off by 0.1 to 20 nats: BENCHMARKS.md, "Engine self-audits")."""
    severity: str = "critical"
    """Of the step's alarm: "critical" halts the step (after the Monitor's dump), "warn" records it."""

    def __post_init__(self) -> None:
        if self.sample < 1:
            raise ConfigError(f"audit sample must be >= 1 rollouts a step, got {self.sample}")
        if self.threshold is not None and not self.threshold > 0:
            raise ConfigError(f"audit threshold must be > 0 nats, got {self.threshold}")
        if self.severity not in SEVERITIES:
            raise ConfigError(f"audit severity must be one of {SEVERITIES}, got {self.severity!r}")

    def limit(self, engine_dtype: str) -> float:
        if self.threshold is not None:
            return self.threshold
        return FP32_ENGINE_TOL if engine_dtype == "float32" else ENGINE_TOL


def check_sampling(rollout: Any) -> None:
    """Refuse (ConfigError) rollout settings whose decode logprobs a prefill cannot reproduce."""
    if rollout.greedy or rollout.logprobs_mode == "raw_logprobs":
        return
    if rollout.temperature != 1.0 or rollout.allow_logit_processing:
        raise ConfigError(
            f"the decode-prefill audit compares with vLLM's prompt logprobs, which are untempered and unprocessed: "
            f"sample at temperature 1 without top-k/top-p (got temperature {rollout.temperature}, logit processing "
            f"{'allowed' if rollout.allow_logit_processing else 'off'}), or use logprobs_mode='raw_logprobs'")


def audit_step(engine: Any, rollouts: list[Any], step: int, cfg: DecodePrefillAudit, engine_dtype: str,
               seed: int = 0) -> tuple[list[Alarm], dict[str, float]]:
    """The step's audit alarms (none or one) and its scalars; `engine` the loop's `RolloutSupervisor`."""
    rng = np.random.default_rng([seed, step, 0xA0D1])
    picked = np.sort(rng.choice(len(rollouts), size=min(cfg.sample, len(rollouts)), replace=False))  # (S,)
    chosen = [rollouts[i] for i in picked]
    prompts = [list(r.prompt_token_ids) for r in chosen]
    responses = [list(r.token_ids) for r in chosen]
    prefill = engine.call(lambda actor: actor.rescore.remote(prompts, responses))
    threshold = cfg.limit(engine_dtype)
    scores, first_of = request_divergence(prefill, [r.logprobs for r in chosen], threshold)  # (S,), S
    worst_of = [float(x) for x in scores]
    failing = [i for i, w in enumerate(worst_of) if w > threshold]
    worst = max(worst_of, default=0.0)
    extra = {AUDIT_FAILING: float(len(failing)), AUDIT_MAX: float(worst), AUDIT_SEQUENCES: float(len(chosen))}
    if not failing:
        return [], extra
    ids = [chosen[i].request_id for i in failing]
    first = first_of[failing[0]]
    return [Alarm("signature", AUDIT_FAILING, step, cfg.severity, (
        f"decode-prefill audit: {len(ids)} of {len(chosen)} re-scored rollouts differ from a fresh prefill of the "
        f"same engine by more than {threshold:g} nats (max {worst:.3g}; first {ids[0]}, from token "
        f"{first}): engine-only evidence of a state fault"), {
        "signature": SIGNATURE, "request_ids": ids[:50], "num_failing": len(ids), "num_audited": len(chosen),
        "max_abs_diff": worst, "threshold": threshold,
        "failing": [{"request_id": chosen[i].request_id, "max_abs_diff": worst_of[i],
                     "first_divergence": first_of[i]} for i in failing[:20]]})], extra

