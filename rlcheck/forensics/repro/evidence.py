"""What `rlcheck repro` says about a case besides whether it fails: where the divergence starts (the
first divergent decoder layer, as `rlcheck localize` finds it), what the engine's self-audits say, and,
for a run whose failure does not come back, which side of the run left the reference.

    layers = localize_case(prober, case, probe)     # RequestLocalization per failing request (at most 3)
    audits = audit_case(prober, case, probe)        # {"decode_prefill": DecodePrefill, "batch_invariance": ...}
    sides = run_sides(source, scorer)               # Sides: the engine's or the trainer's logprobs further off

- localize: the case run again in an eager engine with `LayerCapture` on its failing requests (every
  decoder layer's output at every prefill and decode step, the very schedule that fails), against
  the HF reference's hidden states over prompt + generated tokens (`rlcheck.forensics.localize`).
- decode vs prefill: each batch request's prompt + generated tokens prefilled alone in a fresh engine
  of the case's settings (after its weight update; nothing served before), its logprobs against the
  failing decode's (`rlcheck.forensics.audits.DecodePrefill`).
- batch invariance: the case, the case at max_num_seqs 1 and the case in reversed arrival order
  (`BatchInvariance`): how the same greedy requests' outputs differ between the runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlcheck.forensics.repro.case import Case
from rlcheck.forensics.repro.probe import Probe, Prober

MAX_LOCALIZED = 3


def localize_case(prober: Prober, case: Case, probe: Probe) -> tuple[list[Any], str | None]:
    """(RequestLocalization of up to MAX_LOCALIZED failing batch requests, a note or None)."""
    from rlcheck.forensics.localize.capture import LayerCapture, layer_types, reference_states
    from rlcheck.forensics.localize.compare import localize_request, relative_errors, tolerance_for

    eager = case.with_knob("enforce_eager", True)
    chosen = list(probe.failing[:MAX_LOCALIZED])
    model = prober.scorer_for(case).model
    held: dict[str, Any] = {}

    def before(llm: Any) -> None:
        offset = llm.request_counter.counter  # vLLM numbers the batch's requests from here
        held["ids"] = {str(offset + i): i for i in chosen}
        held["capture"] = LayerCapture(llm, held["ids"], str(model.config.model_type))

    def after(llm: Any, outputs: list[dict[str, Any]]) -> None:
        capture = held.pop("capture")
        held["states"] = {i: capture.states(rid) for rid, i in held["ids"].items()}
        capture.remove()

    run = prober.run(eager, before, after)
    if run.error is not None or "states" not in held:
        return [], f"the eager re-run failed: {run.error}"
    note = None if run.fails else "the eager re-run did not fail: compared on it anyway"
    types, tol = layer_types(model), tolerance_for(case.dtype)
    out = []
    for i in held["ids"].values():
        positions, states = held["states"][i]
        prompt, tokens = list(eager.batch[i].prompt), list(run.tokens[i])
        if positions.size == 0:
            continue
        reference = reference_states(model, prompt + tokens[:-1])
        rel = relative_errors(states, reference[:, positions])
        out.append(localize_request(f"batch request {i}", rel, types, len(prompt), tol, positions=positions,
                                    decoded=True, tokens_match=list(tokens) == list(probe.tokens[i])))
    return out, note


def audit_case(prober: Prober, case: Case, probe: Probe) -> dict[str, Any]:
    """The decode-prefill and batch-invariance audits of the case (see the module docstring)."""
    from rlcheck.forensics.audits import BatchInvariance, DecodePrefill, rescore_prefill
    from rlcheck.forensics.repro.shape import reversed_outputs

    ids = [f"batch request {i}" for i in range(len(case.batch))]
    prompts, responses = [list(r.prompt) for r in case.batch], [list(t) for t in probe.tokens]
    held: dict[str, Any] = {}

    def before(llm: Any) -> None:  # a fresh engine, its weights updated as the case's: prefill each alone
        held["prefill"] = rescore_prefill(llm, prompts, responses, batch_size=1)

    out: dict[str, Any] = {}
    run = prober.run(replace(case, history=()), before_batch=before)
    if "prefill" in held:
        out["decode_prefill"] = DecodePrefill.of(ids, held["prefill"], list(probe.logprobs), threshold=case.threshold,
                                                 seconds=run.seconds)
    else:
        out["decode_prefill_error"] = run.error
    runs = {"the case": probe}
    serial = prober(case.with_knob("max_num_seqs", 1), "audits", charge=False)
    if serial.error is None:
        runs["max_num_seqs=1"] = serial
    if len(case.batch) > 1:
        flipped = prober(replace(case, batch=case.batch[::-1]), "audits", charge=False)
        if flipped.error is None:
            runs["reversed arrival order"] = reversed_outputs(flipped)
    if len(runs) > 1:
        out["batch_invariance"] = BatchInvariance.of(
            ids, {name: (list(p.tokens), list(p.logprobs)) for name, p in runs.items()}, threshold=case.threshold)
    return out


@dataclass(frozen=True)
class Sides:
    """Which side of the run left the reference, over the sequences the run flagged."""

    num_flagged: int  # sequences whose trainer and engine logprobs differ past the threshold
    engine_further: int  # of them: the engine's logprobs further from the reference than the trainer's
    trainer_further: int
    engine_max: float  # max |reference - engine| over them
    trainer_max: float  # max |reference - trainer| over them

    @property
    def side(self) -> str:
        return "trainer" if self.trainer_further > self.engine_further else "engine"

    def describe(self) -> str:
        return (f"of the {self.num_flagged} sequences the run flagged, the trainer's logprobs are further from the "
                f"reference than the engine's on {self.trainer_further}, the engine's on {self.engine_further} "
                f"(max |d| from the reference: trainer {self.trainer_max:.3g}, engine {self.engine_max:.3g} nats)")


def run_sides(seqs: Any, scorer: Any, threshold: float) -> Sides | None:
    """The dump's sequences (`DumpSequences`) scored by the reference: which side is further off. None
    without the trainer's logprobs."""
    from rlcheck.core.stats.sequences import request_divergence
    from rlcheck.forensics.replay import resolve_temperature

    if seqs is None or seqs.logp_train is None:
        return None
    temperature, _ = resolve_temperature(seqs.meta, None)
    reference = scorer.score(seqs.prompts, seqs.responses, temperature=temperature)
    run_d, _ = request_divergence(seqs.logp_train, seqs.logp_rollout, threshold)
    engine_d, _ = request_divergence(reference, seqs.logp_rollout, threshold)
    trainer_d, _ = request_divergence(reference, seqs.logp_train, threshold)
    flagged = np.flatnonzero(run_d > threshold)
    if flagged.size == 0:
        flagged = np.arange(len(run_d))
    e, t = engine_d[flagged], trainer_d[flagged]
    return Sides(int(flagged.size), int(np.sum(e > t)), int(np.sum(t > e)), float(e.max(initial=0.0)),
                 float(t.max(initial=0.0)))
