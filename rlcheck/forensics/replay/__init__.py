"""`rlcheck replay DUMP --model DIR`: every sequence of a forensic dump re-scored by the independent
HF reference, and the requests ranked by how far the rollout engine's logprobs are from it.

    report = replay("runs/exp1/dumps/step_000052", "runs/models/hybrid")
    report.records[0]   # the worst request: max |d| vs the engine and vs the trainer, first
                        # divergence, the decoded tokens around it
    report.failed       # requests whose max |d| vs the engine is over the threshold (CLI: exit 1)

d = logp_reference - logp_rollout per response token, the reference being `HFScorer`: a plain HF
Transformers prefill of prompt + response, log_softmax(logits / T) at each response token. It judges
the engine, the side under test (stale Mamba state and wrapped state indices were found this way:
background/ in the design notes); where the dump holds the trainer's logprobs they are compared with
the reference too, so an engine fault (engine off, trainer on the reference) reads apart from a
trainer-side one (both off). Scoring is batched (packed rows for attention models, length buckets
for Mamba, see `rlcheck.engines.hf`) unless `batch=False`, which scores one sequence at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.limits import ENGINE_TOL
from rlcheck.core.run.dump import META, SEQUENCES, read_dump
from rlcheck.core.stats import StatsConfig
from rlcheck.errors import InputError
from rlcheck.forensics.replay.ranking import ReplayRecord, compare, rank, with_context

DEFAULT_TAU = StatsConfig.divergence_tau
"""|d| above which a token diverges (first_divergence): the monitor's own divergence level."""
DEFAULT_THRESHOLD = ENGINE_TOL
"""Max |d| (nats) vs the engine above which a request fails the replay (`rlcheck.core.limits.ENGINE_TOL`).
fp32 engines agree with the fp32 reference to ~1e-5 and bf16 ones to ~0.1-0.2 (BENCHMARKS.md); a token
whose probability is off by e^0.5 = 1.65x is beyond precision noise, while stale state or a wrapped
index is off by nats."""


@dataclass(frozen=True)
class ReplayReport:
    dump_dir: str
    model: str
    step: int | None
    temperature: float
    temperature_from: str  # "argument", "dump" (meta.json context.sampling) or "default"
    threshold: float
    tau: float
    batched: bool
    records: tuple[ReplayRecord, ...]  # worst first
    num_tokens: int  # response tokens compared
    num_scored_tokens: int  # prompt + response tokens through the model
    score_seconds: float  # the reference's forward passes
    load_seconds: float  # dump, model and tokenizer
    padding_fraction: float  # of the batched forward passes (0 for packed or one at a time)

    @property
    def failed(self) -> tuple[ReplayRecord, ...]:
        """Requests over the threshold (any non-finite logprob counts as over)."""
        return tuple(r for r in self.records if r.score > self.threshold)

    def to_json(self, top: int | None = None) -> list[dict[str, Any]]:
        """The per-request records, worst first (the first `top` of them if given)."""
        return [r.to_dict() for r in self.records[:top]]


@dataclass(frozen=True)
class DumpSequences:
    """What replay needs of a dump, checked: one entry per sequence, dump order."""

    request_ids: list[str]
    indices: list[int]
    prompts: list[list[int]]
    responses: list[list[int]]
    logp_rollout: list[np.ndarray]
    logp_train: list[np.ndarray] | None
    valid: list[np.ndarray] | None
    meta: dict[str, Any]
    first_route_diff: list[int | None] | None = None  # an MoE run's first MoE layer routed otherwise (dump.py)


def replay(
    dump_dir: str | Path,
    model_dir: str | Path | None = None,
    *,
    temperature: float | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    tau: float = DEFAULT_TAU,
    batch: bool = True,
    progress: Callable[[int, int], None] | None = None,
    scorer: Any = None,
) -> ReplayReport:
    """Re-score a dump with the HF reference and rank its requests (see the module docstring).

    model_dir: the model the rollouts came from (HF layout); None: the dump's `context.model`.
    temperature: None takes the dump's sampling temperature (1.0 if it has none, or if the engine
      returned raw, untempered logprobs).
    progress(done_tokens, total_tokens): called as the scoring advances.
    scorer: an `HFScorer` already loaded (then model_dir only names it in the report)."""
    if not (threshold > 0 and tau > 0):
        raise InputError(f"threshold and tau must be > 0, got {threshold} and {tau}")
    start = time.perf_counter()
    seqs = load_sequences(dump_dir)
    model_dir = resolve_model(seqs.meta, model_dir)
    temperature, temperature_from = resolve_temperature(seqs.meta, temperature)
    if scorer is None:
        scorer = load_scorer(model_dir)
    check_vocab(seqs, vocab_size(scorer.model))
    decode = load_decoder(model_dir)
    load_seconds = time.perf_counter() - start

    start = time.perf_counter()
    reference = score(scorer, seqs.prompts, seqs.responses, temperature, batch, progress)
    score_seconds = time.perf_counter() - start
    records = compare(seqs.request_ids, reference, seqs.logp_rollout, seqs.logp_train, tau=tau,
                      valid=seqs.valid, indices=seqs.indices)
    records = [
        with_context(r, seqs.prompts[i], seqs.responses[i], reference[i], seqs.logp_rollout[i], decode)
        for i, r in enumerate(records)
    ]
    return ReplayReport(
        dump_dir=str(dump_dir), model=str(model_dir), step=seqs.meta.get("step"),
        temperature=temperature, temperature_from=temperature_from, threshold=threshold, tau=tau,
        batched=batch, records=tuple(rank(records)), num_tokens=sum(len(r) for r in seqs.responses),
        num_scored_tokens=sum(len(p) + len(r) for p, r in zip(seqs.prompts, seqs.responses, strict=True)),
        score_seconds=score_seconds, load_seconds=load_seconds,
        padding_fraction=scorer.last_padding_fraction if batch else 0.0,
    )


# ---- the dump ------------------------------------------------------------------------------------


def load_sequences(dump_dir: str | Path) -> DumpSequences:
    """The dump's sequences, with tokens, checked for what replay needs."""
    rows, meta = read_dump(check_dump_dir(dump_dir))
    if meta.get("redacted") or any(r.get("response_tokens") is None for r in rows):
        raise InputError(
            f"{dump_dir} holds no token ids (written with redact=True, or by a caller that passed no "
            "tokens): replay re-scores the tokens themselves; dump the step again without redaction"
        )
    for r in rows:
        if r.get("prompt_tokens") is None or len(r["prompt_tokens"]) == 0:
            raise InputError(f"request {r['request_id']!r}: no prompt tokens; the first response token needs its prompt")
        if len(r["response_tokens"]) != len(r["logp_rollout"]):
            raise InputError(f"request {r['request_id']!r}: {len(r['response_tokens'])} response tokens "
                             f"but {len(r['logp_rollout'])} rollout logprobs")
    has_train = all(r["logp_train"].ndim == 1 and len(r["logp_train"]) == len(r["logp_rollout"]) for r in rows)
    has_mask = all(r.get("mask") is not None for r in rows)
    return DumpSequences(
        request_ids=[r["request_id"] for r in rows],
        indices=[int(r.get("index", i)) for i, r in enumerate(rows)],
        prompts=[np.asarray(r["prompt_tokens"]).tolist() for r in rows],  # plain ints, as the engines take them
        responses=[np.asarray(r["response_tokens"]).tolist() for r in rows],
        logp_rollout=[r["logp_rollout"] for r in rows],
        logp_train=[r["logp_train"] for r in rows] if has_train and rows else None,
        valid=[np.asarray(r["mask"], dtype=bool) for r in rows] if has_mask and rows else None,
        meta=meta,
        first_route_diff=[r.get("first_route_diff_layer") for r in rows] if meta.get("routing") else None,
    )


def check_dump_dir(path: str | Path) -> Path:
    """`path` if it is a dump directory; otherwise an InputError that says what one is."""
    path = Path(path)
    if (path / SEQUENCES).is_file() and (path / META).is_file():
        return path
    what = (f"{path} is not a dump directory: a dump is one step's folder, RUN_DIR/dumps/step_NNNNNN/, "
            f"holding {SEQUENCES} and {META} (the monitor writes one when it halts)")
    dumps = sorted(p for p in (path / "dumps").glob("step_*") if p.is_dir())
    if dumps:
        names = ", ".join(p.name for p in dumps[-5:]) + (f" and {len(dumps) - 5} more" if len(dumps) > 5 else "")
        what += f"; {path} is a run directory: pass one of its dumps, e.g. {dumps[-1]} (it has {names})"
    raise InputError(what)


def resolve_model(meta: dict[str, Any], model_dir: str | Path | None) -> Path:
    if model_dir is None:
        model_dir = (meta.get("context") or {}).get("model")
        if not model_dir:
            raise InputError("the dump names no model (meta.json context.model): pass --model DIR")
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise InputError(f"model {str(path)!r} is not a local model directory (HF layout, with config.json)")
    return path


def resolve_temperature(meta: dict[str, Any], temperature: float | None) -> tuple[float, str]:
    """(temperature, where it came from): the argument, else the dump's sampling context, else 1.0."""
    if temperature is not None:
        if not temperature > 0:
            raise InputError(f"temperature must be > 0, got {temperature}")
        return float(temperature), "argument"
    sampling = (meta.get("context") or {}).get("sampling") or {}
    if sampling.get("logprobs_mode") == "raw_logprobs":
        return 1.0, "dump (raw logprobs: untempered)"
    if sampling.get("temperature") is not None:
        return float(sampling["temperature"]), "dump"
    return 1.0, "default"


def check_vocab(seqs: DumpSequences, vocab: int) -> None:
    """Every token id is one the model has, else an InputError naming the first request that is not."""
    for rid, p, r in zip(seqs.request_ids, seqs.prompts, seqs.responses, strict=True):
        ids = np.asarray(p + r, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids.max()) if ids.max() >= vocab else int(ids.min())
            raise InputError(f"request {rid!r}: token id {bad} is outside the model's vocabulary (0..{vocab - 1}); "
                             "is it the model that generated this dump?")


# ---- the reference -------------------------------------------------------------------------------


def load_scorer(model_dir: Path):
    from rlcheck.engines.hf import HFScorer, HFScorerConfig

    try:
        return HFScorer(HFScorerConfig(model=str(model_dir)))
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"cannot load the model in {model_dir}: {exc}") from exc


def vocab_size(model: Any) -> int:
    """Token ids the model can both read and score."""
    return min(model.get_input_embeddings().num_embeddings, int(model.config.vocab_size))


def load_decoder(model_dir: Path) -> Callable[[list[int]], str]:
    """The model's tokenizer as ids -> text (special tokens kept); ids in angle brackets without one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError):
        return lambda ids: "".join(f"<{i}>" for i in ids)
    return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def score(
    scorer: Any,
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    temperature: float,
    batch: bool,
    progress: Callable[[int, int], None] | None,
) -> list[np.ndarray]:
    """Reference logprobs of every response token: batched, or one sequence at a time."""
    total = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    done = 0

    def advance(num_tokens: int) -> None:
        nonlocal done
        done += num_tokens
        if progress is not None:
            progress(done, total)

    if batch:
        return scorer.score(prompts, responses, temperature=temperature, progress=advance)
    out = []
    for p, r in zip(prompts, responses, strict=True):
        out.append(scorer.score_one(p, r, temperature=temperature))
        advance(len(p) + len(r))
    return out
