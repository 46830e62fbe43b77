"""What `rlcheck diagnose` takes from `rlcheck localize`: the decoder layer where the divergence of the
localized requests starts (localize.json beside a dump; numpy-free, read as JSON).

- `localized_weights`: a finding of its own, `weights_out_of_sync`, when every localized divergent
  request starts at the same layer, at position 0, and state-slot reuse does not explain it (not a
  Mamba layer; or requests on never-used slots fail too, or the dump has no slot context): with the same tokens in,
  the engine's layer K computes otherwise than the reference's, i.e. its weights (a partial sync, a
  bad load, an injected perturb-layer) or its kernel.
- `name_layer`: the layer (and position) added to the verdict's evidence: a stale-state or aliasing
  verdict names the Mamba layer that read the wrong state, a weights verdict the wrong layer, a healthy
  one says that no layer diverges; a state verdict localized to a non-Mamba layer says it does not fit;
  an MoE layer whose routing first differs there says so.
An MoE's divergence that starts where its routing first differs (`rlcheck.forensics.localize.routing`) is the routing's,
never a weights finding.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.localize.compare import read_localization

CONFIDENCE = 0.9
"""Of the weights finding: under the engine guard's (0.97) and the slot context's (0.95), which see a
state fault directly, over the logprob shapes (<= 0.85)."""
STATE_CAUSES = ("stale_state", "index_aliasing")


def load_localizations(dump_dirs: list[Path]) -> list[dict[str, Any]]:
    """localize.json of each of these dumps that has one, in their order."""
    return [data for d in dump_dirs if (data := read_localization(d)) is not None]


def _divergent(loc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in loc["requests"] if r.get("first_divergent_layer") is not None]


def _main_layer(requests: list[dict[str, Any]]) -> tuple[tuple[int, str], int]:
    """((layer, type), how many requests) of the most common first divergent layer."""
    return Counter((r["first_divergent_layer"], r["layer_type"]) for r in requests).most_common(1)[0]


def _positions(requests: list[dict[str, Any]]) -> str:
    """Where these requests diverge, in words."""
    if all(r["position"] == 0 for r in requests):
        return "at position 0, the first prompt token (their first prefill)"
    if all(r.get("response_position") == 0 and r.get("phase") == "decode" for r in requests):
        return "at their first decode step (response token 0)"
    pos = sorted(r["position"] for r in requests)
    span = f"position {pos[0]}" if pos[0] == pos[-1] else f"positions {pos[0]}..{pos[-1]}"
    return f"at {span} (token index in prompt + response)"


def _reuse_explains(dump_rows: list[dict[str, Any]]) -> bool:
    """Every failing request of a dump with slot context (`rlcheck stress`) reused a state slot."""
    failing = [row for row in dump_rows if row.get("failed")]
    return bool(failing) and all(row.get("slot_reused") is True for row in failing)


def _routing_explains(requests: list[dict[str, Any]]) -> bool:
    """Every request's routing (an MoE's, `localize.routing`) first differs in its first divergent layer."""
    return all((r.get("routing") or {}).get("decoder_layer") == r["first_divergent_layer"] for r in requests)


def localized_weights(locs: list[dict[str, Any]], dump_rows: list[dict[str, Any]]) -> Finding | None:
    """The weights finding (see the module docstring), or None."""
    for loc in locs:
        bad = _divergent(loc)
        if not bad:
            continue
        (layer, kind), n = _main_layer(bad)
        if n < len(bad) or not all(r["position"] == 0 for r in bad):
            continue
        if kind == "mamba" and _reuse_explains(dump_rows):
            continue  # a Mamba layer wrong from the first token, and only on reused slots: stale state
        if _routing_explains(bad):
            continue  # an MoE layer whose routers chose other experts: the routing, not the weights
        evidence = [f"rlcheck localize: {n} of {len(loc['requests'])} localized requests diverge first at decoder "
                    f"layer {layer} ({kind}), {_positions(bad)}, and every layer below it agrees with the reference "
                    f"(tolerance {loc['tolerance']:g})",
                    "the same tokens go in and only that layer's output differs, from the first token on (a state "
                    "fault would start in a Mamba layer and spare fresh slots): the engine's weights (or kernel) of "
                    f"layer {layer} differ from the reference's"]
        return Finding("weights_out_of_sync", CONFIDENCE, evidence, [], [r["request_id"] for r in bad][:50])
    return None


def name_layer(verdict: Finding, locs: list[dict[str, Any]]) -> None:
    """Add the localization to the verdict's evidence (see the module docstring)."""
    for loc in locs:
        bad = _divergent(loc)
        where = Path(str(loc.get("path", ""))).name
        if not bad:
            if verdict.cause == "healthy":
                verdict.evidence.append(f"rlcheck localize ({where}): none of {len(loc['requests'])} requests "
                                        "diverges at any decoder layer")
            continue
        (layer, kind), n = _main_layer(bad)
        if verdict.cause == "weights_out_of_sync" and any(f"layer {layer} ({kind})" in e for e in verdict.evidence):
            return  # the localization is the finding itself
        same = [r for r in bad if r["first_divergent_layer"] == layer]
        line = (f"rlcheck localize ({where}): {n} of {len(bad)} divergent requests start at decoder layer {layer} "
                f"({kind}), {_positions(same)}")
        if verdict.cause in STATE_CAUSES:
            line += ": the Mamba layer that read the wrong state" if kind == "mamba" else (
                ": not a Mamba layer, which a state fault would reach first; the state verdict does not fit it")
        elif _routing_explains(same):
            line += f", where the engine's routers chose other experts ({same[0]['routing']['num_differ']} tokens)"
        verdict.evidence.append(line)
        return
