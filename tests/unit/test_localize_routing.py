"""`rlcheck localize` on an MoE (`rlcheck.forensics.localize.routing`): the routing comparison, its words,
the console and HTML rendering, and what diagnose makes of a divergence that starts where routing differs."""

from __future__ import annotations

import dataclasses

import numpy as np
from rich.console import Console

from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.localized import localized_weights, name_layer
from rlcheck.forensics.localize.compare import LocalizeResult, localize_request, relative_errors
from rlcheck.forensics.localize.report import render_localization
from rlcheck.forensics.localize.routing import compare_routing, routing_summary, routing_words
from rlcheck.report.localize import localize_section

TYPES = ("attention+moe", "attention+moe", "attention+moe")
TOL = 3e-5
PROMPT = 4


def reference(num_positions: int = 8, seed: int = 0) -> np.ndarray:
    """(N, 3, 2): the HF side's top-2 of 8 experts at 3 MoE layers for positions 0..N-1."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(8)[:2] for _ in range(3)] for _ in range(num_positions)])


def rerouted(ref: np.ndarray, at: dict[tuple[int, int], list[int]]) -> np.ndarray:
    """The engine's side: `ref` with other experts at (position, MoE layer) of `at`."""
    out = ref.copy()
    for (pos, layer), experts in at.items():
        out[pos, layer] = experts
    return out


class TestCompareRouting:
    def test_first_layer_position_and_counts(self):
        """Positions 2..7 compared, decoder layers 1, 3, 5: MoE layer 1 (decoder 3) first differs at
        position 5 (response token 1) on 2 positions; layer 2 on 1 more; an order swap agrees."""
        ref = reference()
        eng = rerouted(ref, {(5, 1): [8, 9], (7, 1): [8, 9], (6, 2): [8, 9], (3, 0): ref[3, 0, ::-1]})
        pos = np.arange(2, 8)
        got = compare_routing(pos, eng[pos], ref, (1, 3, 5), PROMPT, in_dump=2)
        assert got == {"first_diff_layer": 1, "decoder_layer": 3, "position": 5, "response_position": 1,
                       "num_differ": 2, "num_rerouted": 3, "num_positions": 6, "layer_differ": [0, 2, 1],
                       "in_dump": 2}

    def test_alike_everywhere(self):
        """Routing alike at every layer: no layer, no position, nothing differs; a prompt position is no
        response position."""
        ref = reference()
        got = compare_routing(np.arange(8), ref, ref, (0, 1, 2), PROMPT)
        assert got["first_diff_layer"] is None and got["position"] is None and got["num_rerouted"] == 0
        eng = rerouted(ref, {(1, 0): [8, 9]})
        assert compare_routing(np.arange(8), eng, ref, (0, 1, 2), PROMPT)["response_position"] is None


class TestRoutingWords:
    def test_words_and_summary(self):
        """A request's line names the MoE layer with n of m tokens and the run's layer; the summary counts
        requests per first layer; no routing anywhere gives no summary."""
        ref = reference()
        diff = compare_routing(np.arange(8), rerouted(ref, {(5, 1): [8, 9]}), ref, (0, 1, 2), PROMPT, in_dump=0)
        same = compare_routing(np.arange(8), ref, ref, (0, 1, 2), PROMPT)
        assert routing_words(diff) == ("routing first differs at MoE layer 1 (1 of 8 tokens; decoder layer 1, "
                                       "from position 5); in the run: MoE layer 0")
        assert routing_words(same) == "routing agrees at every MoE layer (8 tokens)"
        summary = routing_summary([{"routing": diff}, {"routing": same}, {"routing": None}])
        assert summary == "routing differs in 1 of 2 requests, first at MoE layer 1 in 1"
        assert routing_summary([{"routing": same}]) == "routing agrees at every MoE layer in all 1 requests compared"
        assert routing_summary([{"routing": None}]) is None


def routed_loc(rid: str, layer: int | None, position: int = 5) -> object:
    """A request localized at decoder `layer` from `position` whose routing first differs there (None: clean)."""
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(3, 8, 16))
    eng = ref * (1 + 1e-7 * rng.normal(size=ref.shape))
    experts = reference()
    if layer is not None:
        eng[layer:, position:] *= 1.1
        experts = rerouted(experts, {(position, layer): [8, 9]})
    routing = compare_routing(np.arange(8), experts, reference(), (0, 1, 2), PROMPT)
    return localize_request(rid, relative_errors(eng, ref), TYPES, PROMPT, TOL, routing=routing)


def moe_result(*requests) -> LocalizeResult:
    return LocalizeResult(path="dump", model="m", dtype="float32", tolerance=TOL, tolerance_from="dtype",
                          mode="teacher-forced prefill", fault="moe-route-flip=0.5", layer_types=TYPES,
                          requests=tuple(requests))


class TestRenderRouting:
    def test_console_and_html(self):
        """The console prints each request's routing line and the routing summary; the HTML table gets
        an MoE routing column; a result without routing gets neither."""
        data = moe_result(routed_loc("a", 1), routed_loc("b", None)).to_dict()
        console = Console(record=True, width=200)
        render_localization(data, console)
        text = console.export_text()
        assert "a: routing first differs at MoE layer 1 (1 of 8 tokens; decoder layer 1, from position 5)" in text
        assert "b: routing agrees at every MoE layer" in text
        assert "routing differs in 1 of 2 requests, first at MoE layer 1 in 1" in text
        page = localize_section([data], lambda p: p.name)
        assert "<th>MoE routing</th>" in page and "routing first differs at MoE layer 1" in page
        plain = dataclasses.replace(moe_result(routed_loc("a", 1)), requests=(
            dataclasses.replace(routed_loc("a", 1), routing=None),)).to_dict()
        assert "MoE routing" not in localize_section([plain], lambda p: p.name)


class TestDiagnoseRouting:
    def test_routing_at_the_divergent_layer_is_not_weights(self):
        """Every request wrong from decoder layer 1 at position 0, its routing first differing there: no
        weights finding, and the verdict's line says the routers chose other experts; without the
        routing the same localization is a weights finding."""
        data = moe_result(routed_loc("a", 1, position=0), routed_loc("b", 1, position=0)).to_dict()
        assert localized_weights([data], []) is None
        verdict = Finding("moe_routing", 0.8, ["rerouted tokens carry the mismatch"])
        name_layer(verdict, [data])
        assert "routers chose other experts" in verdict.evidence[-1]
        for r in data["requests"]:
            r["routing"] = None
        assert localized_weights([data], []).cause == "weights_out_of_sync"
