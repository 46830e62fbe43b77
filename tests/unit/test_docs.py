"""RELIABILITY.md names tests that exist (the pages' defaults and snippets: tests/unit/test_docs_site.py)."""

from __future__ import annotations

from pathlib import Path


class TestReliabilityDocs:
    def test_every_named_test_exists(self):
        """Every `file::Class::test` RELIABILITY.md names is a test in that file (parameters stripped)."""
        import ast
        import re

        root = Path(__file__).parents[1]
        text = (root.parent / "RELIABILITY.md").read_text()
        refs = re.findall(r"`((?:unit|integration)/[\w/]+\.py)((?:::[\w\[\]\-.,]+)*)`", text)
        assert len(refs) > 30
        for path, chain in refs:
            tree = ast.parse((root / path).read_text())
            scope = tree.body
            for part in [p.split("[")[0] for p in chain.split("::") if p]:
                found = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part]
                assert found, f"RELIABILITY.md names {path}{chain}: no {part!r}"
                scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
