"""Run a function on a module once it is imported: how the verl plugin (`rlcheck.integrations.verl.plugin`)
wraps verl's trainers without importing them itself.

verl loads its plugins from inside `import verl` (`VERL_USE_EXTERNAL_MODULES`), before any trainer
module exists; importing one there would import half of verl, Ray and torch into every process that
touches verl (vLLM's workers included). `after_import(name, fn)` calls `fn(module)` right after
`name` finishes executing, or at once when it already has.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for a module with pending callbacks it wraps the spec's loader."""

    def find_spec(self, name: str, path: Any, target: Any = None):
        if name not in _pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, name)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self.name, [])
        for fn in callbacks:
            fn(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the real loader
        return getattr(self.inner, name)


_finder = _Finder()


def after_import(name: str, fn: Callable[[ModuleType], None]) -> None:
    """`fn(module)` once module `name` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    with _lock:
        _pending.setdefault(name, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
