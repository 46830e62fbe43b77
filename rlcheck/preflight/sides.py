"""One side of the comparison as a preflight sees it: the model config it computes with, the
generation defaults shipped beside it, and its tokenizer. Read from a model folder (`load_side`) or
from a model already in memory (`side_of_model`, the TRL adapter's trainer).

Configs are read as JSON (no transformers needed); the tokenizer is loaded with transformers'
`AutoTokenizer` only when the folder has one and transformers is installed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Side:
    """What one side loads: `config` (config.json as a dict, None when unreadable), `generation`
    (generation_config.json, {} without one), `tokenizer` (None when there is none to load)."""

    name: str
    """"trainer" or "engine"."""
    path: str | None
    config: dict[str, Any] | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    problems: tuple[str, ...] = ()
    """What could not be read, one line each (reported as info findings)."""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_tokenizer(path: str | os.PathLike[str]) -> tuple[Any, str | None]:
    """(tokenizer, None), or (None, why not) when the folder has none or it does not load."""
    folder = Path(path)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None, f"{folder} has no tokenizer files: tokenizer checks skipped"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder)), None
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported, not raised
        return None, f"the tokenizer in {folder} did not load ({type(exc).__name__}: {exc}): tokenizer checks skipped"


def load_side(name: str, path: str | os.PathLike[str], *, tokenizer: Any = None, with_tokenizer: bool = True) -> Side:
    """The side that loads the model folder `path`; `tokenizer`: the one it uses, when not the folder's."""
    folder = Path(path)
    problems = []
    config = _read_json(folder / "config.json")
    if config is None:
        problems.append(f"{folder} has no readable config.json: model config checks skipped")
    if tokenizer is None and with_tokenizer:
        tokenizer, why = load_tokenizer(folder)
        problems += [why] if why else []
    return Side(name, str(folder), config, _read_json(folder / "generation_config.json") or {}, tokenizer,
                tuple(problems))


def side_of_model(name: str, model: Any, tokenizer: Any = None) -> Side:
    """The side of a model in memory (`model.config`, e.g. a transformers PreTrainedModel), whose
    config may differ from the folder it was loaded from; `tokenizer`: its tokenizer, or the folder's."""
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    on_disk = load_side(name, path, tokenizer=tokenizer) if path and Path(path).is_dir() else Side(name, path)
    cfg = getattr(model, "config", None)
    # to_diff_dict: the fields config.json would hold (save_pretrained writes that), so both sides read alike
    to_dict = getattr(cfg, "to_diff_dict", None) or getattr(cfg, "to_dict", None)
    config = to_dict() if callable(to_dict) else on_disk.config
    problems = tuple(p for p in on_disk.problems if "config.json" not in p or config is None)
    return Side(name, path, config, on_disk.generation, on_disk.tokenizer or tokenizer, problems)


def engine_side(cfg: Any, trainer: Side, engine: Side | None = None) -> Side:
    """The engine's side as vLLM runs it: `engine` (already read), else the trainer's own folder when the engine
    loads the same one (`cfg.engine_path == cfg.model`: read once), else `cfg.engine_path` read; with
    `cfg.engine_overrides` (vLLM's `hf_overrides`) over its config (`with_overrides`). `cfg`: a `PreflightConfig`."""
    if engine is None and cfg.engine_path == cfg.model:
        engine = Side("engine", trainer.path, trainer.config, trainer.generation, trainer.tokenizer)
    return with_overrides(engine or load_side("engine", cfg.engine_path), cfg.engine_overrides)


def with_overrides(side: Side, overrides: dict[str, Any] | None) -> Side:
    """`side` with vLLM's `hf_overrides` set over its config, as vLLM 0.32 sets them (`ModelConfig`): a value
    replaces the field, a dict merges into a nested config (`text_config`, ...) and replaces any other
    field (`rope_parameters` is replaced whole)."""
    if not overrides or side.config is None:
        return side
    config = dict(side.config)
    for key, value in overrides.items():
        nested = key.endswith("_config") and isinstance(value, dict) and isinstance(config.get(key), dict)
        config[key] = {**config[key], **value} if nested else value
    return replace(side, config=config)


def config_dtype(config: dict[str, Any] | None) -> str | None:
    """The dtype a config.json declares ("dtype", or transformers 4's "torch_dtype"), else None."""
    if not config:
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None
