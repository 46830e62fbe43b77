"""The Python snippets of the docs (docs/**/*.md and README.md), found and run as printed.

Every ```python block of a page runs, in a fresh working directory, with nothing imported. A block
that uses what its page only stands for (your engine and trainer, a verl batch, a model folder) is
preceded by a comment naming the environment that provides it, which a rendered page does not show:

    <!-- snippet: own-loop -->

    ```python
    ...
    ```

ENVS says, per environment, what it gives the block (its names, the files it prepares in the working
directory, the settings it makes for the test: a CPU-sized TRL config, a capped step count), what it
checks after the block ran, and whether the block needs vLLM, Ray, TRL or verl: those are `slow`
(tests/docs_envs_slow.py), run by tests/integration/test_docs_snippets.py in a process of their own;
the others (tests/docs_envs.py) by tests/unit/test_docs_site.py in the test's process. A block
without a comment runs in `plain`.

    python -m tests.docs_snippets                  # list every snippet and its environment
    python -m tests.docs_snippets run PAGE INDEX   # run one in this directory (what the slow test does)
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.docs_envs import FAST_ENVS, Env
from tests.docs_envs_slow import SLOW_ENVS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MARKER = re.compile(r"^<!-- snippet: ([\w-]+) -->$")


def pages() -> list[Path]:
    """Every page whose Python blocks must run: the docs and the README."""
    return [*sorted(DOCS.rglob("*.md")), README]


@dataclass(frozen=True)
class Snippet:
    page: str
    """The page's path from the repository root."""
    index: int
    """Its place among the page's Python blocks, from 0."""
    line: int
    """The line of its first code line on the page, from 1."""
    env: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.index}"


def parse(text: str, page: str) -> list[Snippet]:
    """The ```python blocks of one page, each with the environment its marker names (`plain` without one).
    A marker must be followed, after blank lines only, by a Python block (ValueError otherwise)."""
    snippets: list[Snippet] = []
    lines = text.split("\n")
    env, i = None, 0
    while i < len(lines):
        line = lines[i].strip()
        marker = MARKER.match(line)
        if marker:
            env = marker.group(1)
        elif line == "```python":
            end = lines.index("```", i + 1) if "```" in lines[i + 1:] else len(lines)
            code = "\n".join(lines[i + 1:end]) + "\n"
            snippets.append(Snippet(page, len(snippets), i + 2, env or "plain", code))
            env, i = None, end
        elif line and env is not None:
            raise ValueError(f"{page}:{i + 1}: <!-- snippet: {env} --> is not followed by a ```python block")
        i += 1
    return snippets


def collect() -> list[Snippet]:
    """Every snippet of every page."""
    return [s for p in pages() for s in parse(p.read_text(), p.relative_to(ROOT).as_posix())]


ENVS: dict[str, Env] = {**FAST_ENVS, **SLOW_ENVS}
"""Every environment a page's marker may name."""


# ---- running ------------------------------------------------------------------------------------------

class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def _close_monitors(namespace: dict[str, Any]) -> None:
    """Close what the block left open (its Monitor holds the run directory's lock)."""
    from rlcheck import Monitor

    for value in namespace.values():
        if isinstance(value, Monitor):
            value.close()


def run(snippet: Snippet, workdir: Path) -> str:
    """Run `snippet` with its environment in `workdir` (its working directory); what it printed.
    Tracebacks name the page and its line."""
    env = ENVS[snippet.env]
    code = compile("\n" * (snippet.line - 1) + snippet.code, snippet.page, "exec")
    printed = io.StringIO()
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with env.setup() as names:
            namespace = {"__name__": "__main__", **names}
            try:
                with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
                    exec(code, namespace)
            finally:
                _close_monitors(namespace)
            env.check(namespace, printed.getvalue())
    finally:
        os.chdir(cwd)
    return printed.getvalue()


def main(argv: list[str]) -> int:
    snippets = collect()
    if argv[:1] == ["run"]:
        page, index = argv[1], int(argv[2])
        run(next(s for s in snippets if s.page == page and s.index == index), Path.cwd())
        return 0
    for s in snippets:
        print(f"{s.id:<40} line {s.line:<5} {s.env}{' (slow)' if ENVS[s.env].slow else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
