"""The package's layering (ARCHITECTURE.md): every import points down the layer table (`LAYERS`), no
import circle anywhere in rlcheck/, `import rlcheck` and its numpy-only core load no torch, vLLM or Ray,
no module over ~300 lines, and no private module (`_name`) imported from outside its own package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rlcheck"
MAX_LINES = 320  # "about 300"
HEAVY = ("torch", "vllm", "ray", "transformers", "deepspeed", "wandb", "trl")
CORE = ("rlcheck", "rlcheck.core", "rlcheck.core.monitor", "rlcheck.core.run", "rlcheck.core.stats",
        "rlcheck.core.detect", "rlcheck.errors", "rlcheck.sinks", "rlcheck.synthetic", "rlcheck.report.summary",
        "rlcheck.forensics.diagnose", "rlcheck.versions")


LAYERS = (
    ("rlcheck.errors",),
    ("rlcheck.versions",),
    ("rlcheck.core",),
    ("rlcheck.sinks",),  # views of the journal's records: core's types and metric names
    ("rlcheck.core.monitor",),  # composes the core and the sinks (`MonitorConfig.sinks`)
    ("rlcheck",),  # the package's public names
    ("rlcheck.synthetic",),
    ("rlcheck.faults",),
    ("rlcheck.engines",),
    ("rlcheck.trainers",),
    ("rlcheck.preflight",),
    ("rlcheck.loop",),
    ("rlcheck.modelzoo",),  # builds and trains the tiny models, on the loop's task
    ("rlcheck.distributed",),
    ("rlcheck.integrations",),
    ("rlcheck.forensics",),
    ("rlcheck.report",),
    ("rlcheck.demo",),
    ("rlcheck.cli",),
)
"""The layers, lowest first (ARCHITECTURE.md's four, in the order their packages import each other): a
module imports only from its own layer or lower ones. A module is in the layer of the longest prefix
that names it (a package, or one module of it)."""


def layer_of(module: str) -> int:
    """The index in `LAYERS` of the longest prefix naming `module`."""
    best, where = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), i
    if where is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add its package")
    return where


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer than its own, as "module -> import (layer, layer)"."""
    return sorted(f"{name} -> {dep} ({LAYERS[layer_of(name)][0]} < {LAYERS[layer_of(dep)][0]})"
                  for name, deps in graph.items() for dep in deps if layer_of(dep) > layer_of(name))


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root`."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The rlcheck modules `name` imports anywhere in its file (functions and TYPE_CHECKING included):
    `from a.b import c` counts as a.b.c when that is a module, else a.b."""
    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "rlcheck"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] == "rlcheck":
                found |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base)
                          for a in node.names}
    return {m for m in found if m is not None and m != name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


class TestImportGraph:
    def test_no_import_cycle(self):
        """No two rlcheck modules import each other, directly or around a circle."""
        assert cycles(import_graph()) == []

    def test_the_check_finds_a_cycle(self, tmp_path):
        """A package whose two modules import each other (one of them inside a function) is reported."""
        pkg = tmp_path / "rlcheck"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "a.py").write_text("from rlcheck.b import f\n")
        (pkg / "b.py").write_text("def f():\n    from rlcheck import a\n")
        (pkg / "c.py").write_text("import rlcheck.a\n")
        assert cycles(import_graph(pkg)) == [["rlcheck.a", "rlcheck.b"]]

    def test_imports_point_down_the_layers(self):
        """Every rlcheck import points to the module's own layer or a lower one (`LAYERS`): the core never
        imports the runtime, the runtime never the tools; within the runtime, its order."""
        assert upward(import_graph()) == []

    def test_the_check_finds_an_upward_import(self, tmp_path):
        """A core module importing the runtime (inside a function too) is reported; the reverse is not."""
        pkg = tmp_path / "rlcheck"
        for sub in ("core", "engines"):
            (pkg / sub).mkdir(parents=True)
            (pkg / sub / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "core" / "a.py").write_text("def f():\n    from rlcheck.engines import b\n")
        (pkg / "engines" / "b.py").write_text("from rlcheck.core import a\n")
        assert upward(import_graph(pkg)) == ["rlcheck.core.a -> rlcheck.engines.b (rlcheck.core < rlcheck.engines)"]

    def test_no_private_module_imported_from_another_package(self):
        """`rlcheck.x._y` is imported only by modules of `rlcheck.x`."""
        wrong = []
        for name, deps in import_graph().items():
            for dep in deps:
                parent, _, leaf = dep.rpartition(".")
                if leaf.startswith("_") and not leaf.startswith("__") and not name.startswith(parent + "."):
                    wrong.append(f"{name} imports {dep}")
        assert wrong == []


class TestLayout:
    def test_no_module_over_about_300_lines(self):
        long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
        assert long == {}

    def test_only_documented_modules_at_the_root(self):
        """The package root holds packages, plus the two documented modules (errors, versions)."""
        loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
        assert loose == ["errors.py", "versions.py"]

    @pytest.mark.parametrize("module", CORE)
    def test_core_imports_no_torch(self, module):
        """Importing the core (and the readers of a run) in a fresh interpreter loads none of torch,
        vLLM, Ray, transformers, DeepSpeed, wandb or TRL."""
        code = (f"import sys, importlib; importlib.import_module({module!r}); "
                f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]"
