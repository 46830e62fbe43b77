"""The docs' claims about a fault's halt step or the cause diagnose names (`tests/docs_claims.py`): each
is still on its page, each names tests that exist, and no claim line in docs/ goes without an entry."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.docs_claims import CLAIMS, PATTERNS, TABLE_HEADERS

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "benchmarks-full.md")
"""benchmarks-full.md includes BENCHMARKS.md: measurements, each with the command that made it."""


def node_exists(node: str) -> bool:
    """Whether a pytest node id ("file::Class::test" or "file::test") names a test defined in its file."""
    path, *names = node.split("::")
    tree = ast.parse((ROOT / path).read_text())
    scope = tree.body
    for name in names:
        found = next((n for n in scope if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == name), None)
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def claim_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page's claims: lines matching PATTERNS and the rows of a table whose
    header claims a name."""
    out, in_table = [], False
    for i, line in enumerate(page.read_text().splitlines(), 1):
        in_table = (in_table and line.startswith("|")) or any(h in line for h in TABLE_HEADERS)
        if in_table and not set(line) <= set("|- ") or any(re.search(p, line) for p in PATTERNS):
            out.append((i, line))
    return out


class TestDocsClaims:
    @pytest.mark.parametrize(("page", "text", "tests"), CLAIMS, ids=[f"{p}:{t[:30]}" for p, t, _ in CLAIMS])
    def test_each_claim_is_on_its_page_with_tests_that_exist(self, page, text, tests):
        """The claim's text is on its page and every test it names is defined."""
        assert text in (ROOT / page).read_text(), f"{page} no longer says {text!r}"
        assert tests and all(node_exists(t) for t in tests), [t for t in tests if not node_exists(t)]

    @pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
    def test_no_claim_without_a_test(self, page):
        """Every line of docs/ that claims a halt step or a diagnosed cause holds an entry's text."""
        rel = str(page.relative_to(ROOT))
        texts = [t for p, t, _ in CLAIMS if p == rel]
        missing = [f"{rel}:{i}: {line[:100]}" for i, line in claim_lines(page) if not any(t in line for t in texts)]
        assert not missing, "claims without a test (add them to tests/docs_claims.py):\n" + "\n".join(missing)
