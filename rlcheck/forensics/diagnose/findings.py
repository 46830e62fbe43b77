"""What diagnose says: the causes it can name (`CAUSES`), one rule's `Finding` (a cause, a
confidence that ranks it, the evidence in words, the affected steps and request ids) and the ranked
`Diagnosis` of a run or a dump."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CAUSES = {
    "healthy": "healthy: the engine and the trainer agree",
    "numeric_noise": "numeric noise (bf16, kernels, batch variance)",
    "logit_processing": "temperature / logit-processing mismatch",
    "weights_out_of_sync": "weights not synced, or synced late",
    "stale_state": "stale recurrent state (Mamba slot reused, decode before prefill)",
    "index_aliasing": "state-index overflow / aliasing (a slot offset that wrapped)",
    "token_misalignment": "token misalignment (off-by-one, chat template, tokenizer drift)",
    "moe_routing": "MoE routing disagreement (near-tie tokens sent to other experts)",
    "stale_prefix_cache": "stale prefix cache (a prompt prefix cached under old weights, not reset after a sync)",
    "retokenization": "re-tokenization (the trainer scores its own tokenization of the response text)",
    "prompt_mismatch": "prompt mismatch (the trainer's prompt ids are not the engine's: BOS twice, a template)",
    "position_ids": "position ids / padding (left padding without position ids shifts the trainer's positions)",
    "stop_token": "stop token (the stop/EOS token scored on one side, dropped or aligned otherwise on the other)",
    "position_dependent": "position-dependent mismatch (RoPE base, scaling or sliding window differs past a position)",
    "unexplained": "alarms that match no known shape",
}
MIN_NOISE_STEPS = 3
"""Alarmed steps numeric noise needs as its own evidence (alarms of other causes, `weights`, not
counted): one step after a halt is no persistent rise."""
@dataclass
class Finding:
    cause: str
    confidence: float
    evidence: list[str]
    affected_steps: list[int] = field(default_factory=list)
    affected_request_ids: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return CAUSES[self.cause]

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "confidence": round(self.confidence, 3),
                "evidence": self.evidence, "affected_steps": self.affected_steps,
                "affected_request_ids": self.affected_request_ids}


@dataclass
class Diagnosis:
    source: str
    path: str
    num_steps: int
    findings: list[Finding]

    @property
    def verdict(self) -> Finding:
        return self.findings[0]

    @property
    def healthy(self) -> bool:
        return self.verdict.cause == "healthy"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "num_steps": self.num_steps,
                "verdict": self.verdict.to_dict(), "findings": [f.to_dict() for f in self.findings]}
