"""Path arguments of the `rlcheck` command, checked before any work starts; a bad one is a
`PathError` (`rlcheck: error: ...`, exit code 2).

Inputs (run directories, dumps, model folders) must exist and be directories. Outputs:

- an output directory (`demo --run-dir`, `stress --out`, `sweep --out`) must be missing, empty, or
  hold the same command's earlier output (`stress.json`, `sweep.json`: rewritten; `stress` replaces
  its directory whole). Any other non-empty directory is refused, never written into: a typo must
  not put a dump over someone's files. `demo` always wants a new or empty one (an earlier run is
  not continued: its Monitor would refuse it).
- no output goes into a model folder (config.json beside weights), or below one: model folders are
  copied, uploaded and hashed as a unit.
- `make-model --force` replaces only a folder `make-model` built (it holds rlcheck_model.json).
- a file output (`report --out`) may replace an existing .html file only.
- whatever does not exist yet must be creatable: its nearest existing parent is a writable directory.

No command runs a shell or another program; paths are only read, created and written.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlcheck.errors import PathError

MODEL_CONFIG = "config.json"
MODEL_MANIFEST = "rlcheck_model.json"  # rlcheck.modelzoo.build.MANIFEST (not imported: it pulls in torch)


def existing_dir(path: Path, what: str) -> Path:
    """An input directory: it exists and is a directory."""
    if not path.exists():
        raise PathError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise PathError(f"{what} {path} is a file, not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise PathError(f"{what} {path} cannot be read (permissions)")
    return path


def optional_dir(path: Path | None, what: str) -> Path | None:
    return None if path is None else existing_dir(path, what)


def output_dir(path: Path, what: str, own_marker: str | None = None) -> Path:
    """A directory rlcheck will create or write into (see the module docstring)."""
    if path.exists() and not path.is_dir():
        raise PathError(f"{what} {path} is a file, not a directory")
    _outside_models(path, what)
    if path.is_dir() and any(path.iterdir()):
        if own_marker is None or not (path / own_marker).is_file():
            mine = f" (or one holding an earlier {own_marker})" if own_marker else ""
            raise PathError(f"{what} {path} is not empty; rlcheck writes only into a new or empty directory{mine}: "
                            "choose another")
    return _creatable(path, what)


def output_file(path: Path | None, what: str, suffixes: tuple[str, ...] = (".html", ".htm")) -> Path | None:
    """A file rlcheck will write (its directory created if needed): not a directory, and replacing
    only a file of one of `suffixes`."""
    if path is None:
        return None
    if path.is_dir():
        raise PathError(f"{what} {path} is a directory; name the file to write, e.g. {path / 'report.html'}")
    if path.exists() and path.suffix.lower() not in suffixes:
        raise PathError(f"{what} {path} exists and is not a {'/'.join(suffixes)} file; rlcheck will not replace it")
    _outside_models(path.parent, what)
    _creatable(path.parent, what)
    return path


def model_output(path: Path, force: bool) -> Path:
    """`make-model OUT`: missing or empty; with --force also a folder make-model built before."""
    if path.exists() and not path.is_dir():
        raise PathError(f"OUT {path} is a file, not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not force:
            raise PathError(f"OUT {path} exists and is not empty; pass --force to replace a model make-model built")
        if not (path / MODEL_MANIFEST).is_file():
            raise PathError(f"OUT {path} is not a model make-model built (no {MODEL_MANIFEST}); --force replaces "
                            "only those: choose a new or empty directory")
    return _creatable(path, "OUT")


def model_source(path: Path, what: str) -> Path:
    """A model folder the command loads, or (when missing or empty) builds there."""
    if path.exists():
        existing_dir(path, what)
        if any(path.iterdir()) and not (path / MODEL_CONFIG).is_file():
            raise PathError(f"{what} {path} is neither a model folder (no {MODEL_CONFIG}) nor empty")
        return path
    return _creatable(path, what)


def is_model_dir(path: Path) -> bool:
    """A Hugging Face model folder: config.json beside weights (or rlcheck's manifest)."""
    if not (path / MODEL_CONFIG).is_file():
        return False
    return (path / MODEL_MANIFEST).is_file() or any(
        next(path.glob(pattern), None) is not None for pattern in ("*.safetensors", "*.bin", "*.pt", "*.gguf"))


def _outside_models(path: Path, what: str) -> None:
    resolved = path.resolve()
    for parent in (resolved, *resolved.parents):
        if is_model_dir(parent):
            raise PathError(f"{what} {path} is inside the model folder {parent}; write outputs elsewhere")


def _creatable(path: Path, what: str) -> Path:
    """`path` exists as a writable directory, or its nearest existing parent is one."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise PathError(f"{what} {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PathError(f"{what} {path}: {probe} is not writable")
    return path
