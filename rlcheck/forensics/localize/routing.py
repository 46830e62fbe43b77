"""MoE routing in `rlcheck localize`: the first MoE layer where the engine's routers chose other experts
than the HF reference's for the same tokens, in the same re-run as the hidden states (an MoE model only).

    with reference_routes(hf_model, moe=True) as routes:               # RouteRecorder on the HF routers
        reference = reference_states(hf_model, token_ids)             # the reference's one forward
    routing = compare_routing(run.positions, run.experts, routes.experts(), moe_layers, prompt_len)
    routing_words(routing)   # "routing first differs at MoE layer 1 (3 of 20 tokens; decoder layer 1, from position 9)"

The engine's experts come from `RouteCapture` on the re-run (`rlcheck.forensics.localize.engine`), at
every position whose hidden state localize compares (prompt + response but its last token); a position
agrees at an MoE layer when both sides picked the same expert *set* (`rlcheck.core.moe.same_experts`).
Why a routing difference matters: the two sides then run different experts on that token, so its hidden
state differs from that decoder layer on whatever the numerics. The dump's own view (`first_route_diff_layer`
of the run, `rlcheck.core.run.dump`) goes along as `in_dump`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.moe import first_diff_layer, same_experts


def moe_layers(model: Any) -> tuple[int, ...]:
    """The decoder layer index of every MoE layer of an HF or vLLM model (`moe_gates`' order); () for a
    model without MoE layers."""
    from rlcheck.engines.layers import decoder_layers

    return tuple(i for i, layer in enumerate(decoder_layers(model)) if hasattr(getattr(layer, "mlp", None), "gate"))


def reference_routes(model: Any, moe: bool) -> Any:
    """A `RouteRecorder` on the HF model's routers when `moe` (a context manager; else one that gives None)."""
    if not moe:
        return contextlib.nullcontext()
    from rlcheck.trainers.moe_routing import RouteRecorder

    return RouteRecorder(model)


def compare_routing(positions: np.ndarray, engine: np.ndarray, reference: np.ndarray, decoder_layers: Sequence[int],
                    prompt_len: int, in_dump: int | None = None) -> dict[str, Any]:
    """Where the engine's experts `engine` (T, L, k) at `positions` (T,) first differ from the reference's
    `reference` (N, L, k) at positions 0..N-1; `decoder_layers` (L,): each MoE layer's decoder layer.

    Returns first_diff_layer (the lowest MoE layer where some position differs; None if none), its
    decoder_layer, position (the first position that differs there) and response_position (the same from
    the first response token; None inside the prompt), num_differ (positions that differ there),
    num_rerouted (positions that differ at some layer), num_positions, layer_differ (per MoE layer),
    in_dump (the run's first differing MoE layer, from the dump)."""
    agree = same_experts(engine, reference[positions])  # (T, L)
    differ = ~agree
    first = first_diff_layer(agree)  # (T,)
    num_layers = agree.shape[1]
    layer = int(first.min()) if first.size and first.min() < num_layers else None
    out: dict[str, Any] = {"first_diff_layer": layer, "decoder_layer": None, "position": None,
                           "response_position": None, "num_differ": 0,
                           "num_rerouted": int(differ.any(axis=1).sum()), "num_positions": int(agree.shape[0]),
                           "layer_differ": [int(c) for c in differ.sum(axis=0)], "in_dump": in_dump}
    if layer is not None:
        position = int(positions[np.flatnonzero(differ[:, layer])[0]])
        out.update(decoder_layer=int(decoder_layers[layer]), position=position, num_differ=int(differ[:, layer].sum()),
                   response_position=position - prompt_len if position >= prompt_len else None)
    return out


def routing_words(routing: dict[str, Any]) -> str:
    """One request's routing comparison in words (see the module docstring for an example)."""
    m = routing["num_positions"]
    if routing.get("first_diff_layer") is None:
        text = f"routing agrees at every MoE layer ({m} tokens)"
    else:
        text = (f"routing first differs at MoE layer {routing['first_diff_layer']} ({routing['num_differ']} of {m} "
                f"tokens; decoder layer {routing['decoder_layer']}, from position {routing['position']})")
    if "in_dump" in routing and routing["in_dump"] is not None:
        text += f"; in the run: MoE layer {routing['in_dump']}"
    return text


def routing_summary(requests: Sequence[dict[str, Any]]) -> str | None:
    """"routing differs in 6 of 8 requests, first at MoE layer 0 in 6" over the requests' JSON form; None
    when none of them has a routing comparison (not an MoE)."""
    routed = [r["routing"] for r in requests if r.get("routing")]
    if not routed:
        return None
    firsts = [r["first_diff_layer"] for r in routed if r["first_diff_layer"] is not None]
    if not firsts:
        return f"routing agrees at every MoE layer in all {len(routed)} requests compared"
    layers = ", ".join(f"MoE layer {k} in {firsts.count(k)}" for k in sorted(set(firsts), key=lambda k: -firsts.count(k)))
    return f"routing differs in {len(firsts)} of {len(routed)} requests, first at {layers}"
