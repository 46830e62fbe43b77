"""How `rlcheck localize` judges one request, and the result it leaves in the dump (numpy only).

    rel = relative_errors(engine, reference)    # (L, T) from two (L, T, H) stacks of hidden states
    loc = localize_request("7", rel, ("mamba", "mamba", "attention", "mamba"), prompt_len=9, tolerance=3e-5)
    loc.first_divergent_layer, loc.layer_type, loc.position, loc.response_position
    result.write(dump_dir); read_localization(dump_dir)    # DUMP/localize.json

The quantity compared is the residual stream after each decoder layer (what the next layer reads; the
last layer's before the final norm), at every token position the engine computed: prompt + response
minus the last response token, which vLLM never feeds back. Per layer l and position t:

    rel[l, t] = ||h_engine[l, t] - h_reference[l, t]||_2 / ||h_reference[l, t]||_2    (over the hidden dim)

A layer diverges where rel exceeds the tolerance of the engine's dtype (TOLERANCES). The first
divergent layer is the lowest one that diverges at any position: layer l reads only layers below it
(and its own state from earlier positions), never a later layer, so the lowest wrong layer is where
the wrong computation is first seen; every later layer inherits it. Its `position` is the first
position where that layer diverges.

Positions count the tokens of prompt + response from 0, the first prompt token. The row at position t
reads token t and gives the logprob of token t + 1: the logprob of response token r comes from
position prompt_len - 1 + r. `response_position` counts the same position from the first response
token (position - prompt_len; None for a prompt position, which the engine computed in a prefill),
and `phase` says which it was: "prefill" (prompt) or "decode" (a response token fed back).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.limits import dtype_name

RESULT_FILE = "localize.json"
PLOT_FILE = "localize.png"
TOLERANCES = {"float32": 3e-5, "bfloat16": 0.1, "float16": 0.02}
"""Relative error of a layer's output past which it diverges, by the engine's dtype (the reference runs
in float32). float32: a healthy vLLM engine agrees with the HF reference to <= 1e-6 at every layer
and position (tiny hybrid, trained and random, 10 requests x 64 tokens), while a 1% scale of one
layer's output projection moves that layer by >= 2e-4 at every position: 3e-5 sits 30x over the noise
and 7x under the smallest fault. bfloat16: the same healthy engine differs by up to 1.8e-2 (rounding
of every activation), so 0.1 (5x over it) finds gross faults (stale or aliased state, a wrong layer),
not a 1% one. float16: bfloat16's scaled to its 8x finer mantissa (not measured here). A bfloat16 or
float16 reference (`--reference-dtype`) brings its own rounding: the looser of the two dtypes' tolerances
judges (`tolerance_for`)."""


def tolerance_for(*dtypes: str | None) -> float:
    """The divergence tolerance of a comparison between these dtypes (the engine's, the reference's;
    torch names and short ones too): the loosest of theirs. "auto" or None (the engine's dtype not
    recorded) gets the loosest of all: judging an engine that may have run in bfloat16 at the float32
    tolerance would call its rounding a divergence at layer 0."""
    names = [dtype_name(d) if d is not None else "auto" for d in dtypes] or ["auto"]
    if "auto" in names:
        return max(TOLERANCES.values())
    unknown = [d for d in names if d not in TOLERANCES]
    if unknown:
        raise ValueError(f"no localize tolerance for dtype {unknown[0]!r}; pass one (--tolerance)")
    return max(TOLERANCES[d] for d in names)


def relative_errors(engine: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """(L, T) relative L2 error of each layer's hidden state at each position; inf where the engine's
    is not finite. `engine`, `reference`: (L, T, H)."""
    if engine.shape != reference.shape:
        raise ValueError(f"engine states {engine.shape} and reference states {reference.shape} differ in shape")
    e, r = engine.astype(np.float64), reference.astype(np.float64)
    num = np.linalg.norm(e - r, axis=-1)  # (L, T)
    den = np.maximum(np.linalg.norm(r, axis=-1), np.finfo(np.float64).tiny)
    rel = num / den
    rel[~np.isfinite(e).all(axis=-1)] = np.inf
    return rel


@dataclass(frozen=True)
class LayerError:
    index: int
    type: str  # "attention", "mamba", "mlp" or "moe" (+ "+moe" for a routed MoE MLP: "attention+moe")
    max_rel_err: float  # over the positions
    first_position: int | None  # first position over the tolerance (None: within it everywhere)
    worst_position: int  # where max_rel_err is


@dataclass(frozen=True)
class RequestLocalization:
    request_id: str
    first_divergent_layer: int | None  # None: every layer within the tolerance at every position
    layer_type: str | None
    position: int | None  # first position where that layer diverges (0: the first prompt token)
    response_position: int | None  # the same, from the first response token; None inside the prompt
    phase: str | None  # "prefill" or "decode": how the engine computed that position
    prompt_len: int
    num_positions: int  # positions compared: prompt_len + response tokens - 1
    layers: tuple[LayerError, ...]
    tokens_match: bool = True  # the re-run generated the dump's tokens
    note: str | None = None
    routing: dict[str, Any] | None = None  # an MoE's routing, engine vs reference (`routing.compare_routing`)

    @property
    def diverged(self) -> bool:
        return self.first_divergent_layer is not None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = [{**asdict(layer), "max_rel_err": _finite(layer.max_rel_err)} for layer in self.layers]
        return out


def localize_request(request_id: str, rel: np.ndarray, layer_types: tuple[str, ...], prompt_len: int,
                     tolerance: float, *, positions: np.ndarray | None = None, decoded: bool = True,
                     tokens_match: bool = True, note: str | None = None,
                     routing: dict[str, Any] | None = None) -> RequestLocalization:
    """The first divergent layer and position of one request, from its (L, T) relative errors.
    `positions`: the token position of each column (default 0..T-1); `decoded`: False when the engine
    computed the response positions in a prefill too (teacher-forced), so every phase is "prefill";
    `routing`: an MoE's routing comparison, kept as it is."""
    num_layers, num_positions = rel.shape
    if len(layer_types) != num_layers:
        raise ValueError(f"{len(layer_types)} layer types for {num_layers} layers")
    positions = np.arange(num_positions) if positions is None else np.asarray(positions, dtype=np.int64)
    if positions.shape != (num_positions,):
        raise ValueError(f"{positions.shape[0]} positions for {num_positions} columns")
    rel = np.where(np.isnan(rel), np.inf, rel)  # NaN counts as over the tolerance
    worst = rel.argmax(axis=1) if num_positions else np.zeros(num_layers, dtype=np.int64)  # (L,)
    layers = tuple(
        LayerError(i, layer_types[i], float(rel[i, worst[i]]) if num_positions else 0.0,
                   _first(rel[i] > tolerance, positions), int(positions[worst[i]]) if num_positions else 0)
        for i in range(num_layers))
    first = next((layer for layer in layers if layer.first_position is not None), None)
    position = None if first is None else first.first_position
    in_response = position is not None and position >= prompt_len
    return RequestLocalization(
        request_id=request_id, first_divergent_layer=None if first is None else first.index,
        layer_type=None if first is None else first.type, position=position,
        response_position=position - prompt_len if in_response else None,
        phase=None if position is None else ("decode" if in_response and decoded else "prefill"),
        prompt_len=prompt_len, num_positions=num_positions, layers=layers, tokens_match=tokens_match, note=note,
        routing=routing)


def _first(mask: np.ndarray, positions: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(positions[hits[0]]) if hits.size else None


def _finite(x: float) -> float | str:
    return x if np.isfinite(x) else "inf"


@dataclass(frozen=True)
class LocalizeResult:
    path: str  # the dump (or stress output) localized
    model: str
    dtype: str  # the engine's ("auto": not recorded)
    tolerance: float
    tolerance_from: str  # "dtype" (the engine's and the reference's, the looser) or "argument"
    mode: str  # "stress re-run" (the whole workload again, its fault re-injected) or "teacher-forced prefill"
    fault: str  # the engine fault the re-run injected ("none")
    layer_types: tuple[str, ...]
    requests: tuple[RequestLocalization, ...]  # worst first, as localized
    seconds: dict[str, float] = field(default_factory=dict)
    plot: str | None = None

    @property
    def divergent(self) -> tuple[RequestLocalization, ...]:
        return tuple(r for r in self.requests if r.diverged)

    def to_json(self) -> list[dict[str, Any]]:
        """The per-request list (`rlcheck localize --json`)."""
        return [r.to_dict() for r in self.requests]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "model": self.model, "dtype": self.dtype, "tolerance": self.tolerance,
                "tolerance_from": self.tolerance_from, "mode": self.mode, "fault": self.fault,
                "layer_types": list(self.layer_types), "seconds": self.seconds, "plot": self.plot,
                "num_requests": len(self.requests), "num_divergent": len(self.divergent),
                "requests": self.to_json()}

    def write(self, directory: str | Path) -> Path:
        """DIRECTORY/localize.json (replaced)."""
        path = Path(directory) / RESULT_FILE
        tmp = path.with_name(f".{RESULT_FILE}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False))
        tmp.replace(path)
        return path


def read_localization(directory: str | Path) -> dict[str, Any] | None:
    """DIRECTORY/localize.json as written by `LocalizeResult.write`; None when there is none (or it is unreadable)."""
    path = Path(directory) / RESULT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("requests"), list) else None
