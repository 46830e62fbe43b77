"""Did the weight sync reach the engine? The numbers both sides compute, and the verdict.

    engine = llm.apply_model(engine_fingerprint)[0]             # rlcheck.engines.fingerprint
    trainer = merge_fingerprints(rank_parts)                     # rlcheck.trainers.fingerprint, per rank
    check = compare(version, engine, trainer, probe=probe_result)
    monitor.observe(step + 1, batch, alarms=check.alarms(step + 1))   # critical `weights` alarm if stale

A fingerprint maps "LAYER:GROUP" to (sum, sum of squares, sum of |x|, ordered sum), in float64, of
values rounded to the engine's dtype; the ordered sum weighs each value of a linear layer by a hash of
its output row and its weight's name (`rlcheck.engines.fingerprint.order_weights`), so a permutation
of rows, which leaves the plain sums as they are, changes it (NaN where not computed: parameters,
which an engine may hold in a backend's own layout). LAYER is a decoder layer index, "embed" (token embeddings) or "head" (final
norm and LM head); GROUP is
- "linear": the engine's linear layers probed with one-hot rows at `probe_columns(K)` of their K
  inputs, i.e. those columns of the weight exactly as the engine computes with them (a GEMM of a
  one-hot row is exact in any precision, and it reads packed or backend-owned weights, which vLLM's
  CPU backend no longer holds as parameters); the trainer takes the same columns of its weights.
  Fused layers (qkv, gate_up, in_proj) give the concatenation of their parts, each row weighed as the
  row of its part (`packed_modules_mapping`) in the ordered sum.
- "params": every other parameter (norms, conv, Mamba A / D / dt_bias, biases, embeddings, LM head),
  Mamba's A as the engine holds it, -exp(A_log).
- "buffers": buffers derived from the weights, which a reload may leave behind: each Mamba mixer's
  `conv_weights`, expected to equal its conv1d weights.
Sharded trainers fingerprint their own shards; the sums of the ranks' parts are the whole's.

Both sides read the same values, so they agree to float64 rounding (measured: <= 2e-16 relative on
the tiny Llama, Mamba2 and hybrid, fp32 and bf16 engines against an fp32 trainer); `rtol` (1e-9) is
far below what one update leaves (a bf16 weight moved by one rounding step changes the sums of its
layer by ~1e-6 relative). The functional probe (`ProbeResult`) scores a fixed teacher-forced batch
on both sides and is judged at the dtype's tolerance, `PROBE_TOLERANCE`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlcheck.core.types import Alarm
from rlcheck.errors import ConfigError

Fingerprint = dict[str, tuple[float, ...]]

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PROBE_COLUMNS = 16
DEFAULT_RTOL = 1e-9
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}
"""Mean |d| over the probe's tokens above which the probe fails, per engine dtype: 1000x the fp32
agreement (~1e-6), and past the bf16 floor of the loop's probe (BENCHMARKS.md, "Sync check")."""
GROUPS = {"linear": "linear layers", "params": "parameters", "buffers": "derived buffers (Mamba conv_weights)"}


def layer_key(name: str) -> str:
    """"3" for a tensor of decoder layer 3 ("model.layers.3.mlp.down_proj.weight"), "embed" for the
    token embeddings, "head" for everything else outside the layers (final norm, LM head)."""
    m = LAYER_RE.search(name)
    if m:
        return m.group(1)
    return "embed" if "embed" in name else "head"


def probe_columns(k: int, count: int = PROBE_COLUMNS) -> list[int]:
    """The input columns a linear layer of `k` inputs is probed at: `count` of them, evenly spread."""
    count = min(count, k)
    return [(i * k) // count for i in range(count)]


def merge_fingerprints(parts: Iterable[Mapping[str, Iterable[float]]]) -> Fingerprint:
    """The fingerprint of the whole from those of its shards (their sums, key by key; an order
    component one shard lacks, NaN, is NaN in the whole)."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, values in part.items():
            values = list(values)
            acc = out.setdefault(key, [0.0] * len(values))
            for i, v in enumerate(values):
                acc[i] += float(v)
    return {k: tuple(v) for k, v in out.items()}


def differing_keys(engine: Mapping[str, Any], trainer: Mapping[str, Any], rtol: float = DEFAULT_RTOL) -> list[str]:
    """The keys whose sums differ past `rtol` (sum and sum of |x| relative to sum of |x|, sum of
    squares relative to itself), or are not finite on a side (weights gone NaN or infinite: on
    both sides too), or that one side lacks; sorted by layer."""
    out = []
    for key in set(engine) | set(trainer):
        if key not in engine or key not in trainer:
            out.append(key)
            continue
        (s1, q1, a1, *o1), (s2, q2, a2, *o2) = engine[key], trainer[key]
        scale, tiny = max(a1, a2), 1e-30
        if not (close(s1, s2, rtol * scale + tiny) and close(q1, q2, rtol * max(q1, q2) + tiny)
                and close(a1, a2, rtol * scale + tiny)):
            out.append(key)
        elif o1 and o2 and math.isfinite(o1[0]) and math.isfinite(o2[0]) and abs(o1[0] - o2[0]) > rtol * scale + tiny:
            out.append(key)  # the same values in another order: rows a sync permuted
    return sorted(out, key=_order)


def close(a: float, b: float, tol: float) -> bool:
    """|a - b| <= tol with both finite: a NaN or infinity on either side is never "close" (the
    comparison `abs(a - b) > tol` is False for NaN, and would pass it)."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol


def _order(key: str) -> tuple[int, str]:
    layer, _, group = key.partition(":")
    return (int(layer), group) if layer.isdigit() else (-1 if layer == "embed" else 1 << 30, group)


@dataclass(frozen=True)
class ProbeResult:
    """The functional probe: the engine's logprobs of a fixed teacher-forced batch against the trainer's."""

    tokens: int
    mean_abs: float
    max_abs: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.mean_abs) and math.isfinite(self.max_abs) and self.mean_abs <= self.tolerance


@dataclass(frozen=True)
class SyncCheck:
    """The verdict on one sync: the engine's weights (version `version`) against the trainer's."""

    version: int
    differing: tuple[str, ...] = ()
    """"LAYER:GROUP" keys whose fingerprints differ (see the module docstring)."""
    probe: ProbeResult | None = None
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differing and (self.probe is None or self.probe.ok)

    @property
    def layers(self) -> list[int]:
        """The decoder layers found stale (indices, ascending)."""
        return sorted({int(k.partition(":")[0]) for k in self.differing if k.partition(":")[0].isdigit()})

    def metrics(self) -> dict[str, float]:
        """Scalars for the step's `extra` (the loop logs them beside the Monitor's)."""
        out = {"sync/check_seconds": self.seconds, "sync/fingerprint_differs": float(len(self.differing))}
        out.update({f"sync/{k}": float(v) for k, v in self.details.items() if isinstance(v, int | float) and not isinstance(v, bool)})
        if self.probe is not None:
            out["sync/probe_mean_abs"] = self.probe.mean_abs
        return out

    def alarms(self, step: int) -> list[Alarm]:
        """[] when the engine holds the trainer's weights, else one critical `weights` alarm at `step`,
        the step whose rollouts the checked weights generated; `details["layers"]` names the decoder layers."""
        if self.ok:
            return []
        parts = []
        if self.differing:
            groups = sorted({k.partition(":")[2] for k in self.differing})
            where = f"decoder layer(s) {self.layers}" if self.layers else "no decoder layer"
            others = sorted({k.partition(":")[0] for k in self.differing if not k.partition(":")[0].isdigit()})
            parts.append(f"the engine's {', '.join(GROUPS.get(g, g) for g in groups)} differ from the trainer's "
                         f"in {where}" + (f" and {', '.join(others)}" if others else ""))
        if self.probe is not None and not self.probe.ok:
            agree = "" if self.differing else ", while the fingerprints agree (the weights are in; its computation is not)"
            parts.append(f"the probe batch scores {self.probe.mean_abs:.3g} mean |d| apart "
                         f"(tolerance {self.probe.tolerance:g}){agree}")
        if self.details.get("at_start"):
            message = ("the weights the engine loaded do not match the trainer's: " + "; ".join(parts)
                       + " (a different checkpoint, or a layer loaded wrong)")
        else:
            message = (f"the weight sync to version {self.version} did not take: " + "; ".join(parts)
                       + " (a sync that left tensors out, or a buffer the reload did not refresh)")
        details = {"version": self.version, "layers": self.layers, "differing": list(self.differing),
                   "probe": None if self.probe is None else asdict(self.probe), **self.details}
        return [Alarm("weights", "rlcheck/weights/sync_check", step, "critical", message, details)]


def compare(version: int, engine: Mapping[str, Any], trainer: Mapping[str, Any], *, probe: ProbeResult | None = None,
            rtol: float = DEFAULT_RTOL, seconds: float = 0.0, details: Mapping[str, Any] | None = None) -> SyncCheck:
    """The verdict on a sync to `version` from both sides' fingerprints (and the probe, if run)."""
    return SyncCheck(version, tuple(differing_keys(engine, trainer, rtol)), probe, seconds, dict(details or {}))


@dataclass(frozen=True)
class SyncCheckConfig:
    """When the loop checks a sync: the fingerprints every `fingerprint_every` syncs, the probe every
    `probe_every` (0: never); both measured against the loop's step in BENCHMARKS.md ("Sync check")."""

    fingerprint_every: int = 1
    probe_every: int = 10
    probe_prompts: int = 2
    probe_tokens: int = 16
    rtol: float = DEFAULT_RTOL

    def __post_init__(self) -> None:
        if self.fingerprint_every < 0 or self.probe_every < 0:
            raise ConfigError("fingerprint_every and probe_every must be >= 0 (0: never)")
        if self.probe_prompts < 1 or self.probe_tokens < 1 or not self.rtol > 0:
            raise ConfigError("probe_prompts and probe_tokens must be >= 1 and rtol > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.fingerprint_every or self.probe_every)

    def due(self, sync_index: int) -> tuple[bool, bool]:
        """(fingerprint, probe) due at the `sync_index`-th sync of the run (from 1)."""
        return (bool(self.fingerprint_every) and sync_index % self.fingerprint_every == 0,
                bool(self.probe_every) and sync_index % self.probe_every == 0)
