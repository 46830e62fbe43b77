"""The docs site in a real browser: `mkdocs build --strict` into a temporary folder, then headless Chromium
(the system's, driven by playwright, as for the report) opens the quickstart page and the top-level API
page from file:// URLs (mkdocs.yml: use_directory_urls false) and finds their headings, code and the
rendered docstrings, with no script error and no request leaving the machine (mkdocs.yml: font false)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docs_snippets
from tests.integration.test_report_browser import watched_page

MKDOCS = str(Path(sys.executable).with_name("mkdocs"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it, in a temporary folder."""
    out_dir = tmp_path_factory.mktemp("docs") / "site"
    out = subprocess.run([MKDOCS, "build", "--strict", "-d", str(out_dir)], cwd=docs_snippets.ROOT,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out_dir


def visit(path: Path) -> dict:
    """Load one page; what its article shows (headings with their ids, code, text), the site's navigation,
    and the problems met on the way (console and script errors, failed or remote requests)."""
    problems: list[str] = []
    urls: list[str] = []
    with watched_page(problems, urls) as page:
        page.goto(path.as_uri(), wait_until="load")
        shown = {tag: [h.rstrip("¶").strip() for h in page.locator(f"article {tag}").all_inner_texts()]
                 for tag in ("h1", "h2", "h3")}
        shown.update(ids=page.eval_on_selector_all("article h2, article h3", "els => els.map(e => e.id)"),
                     code=page.locator("article pre code").all_inner_texts(),
                     text=page.locator("article").inner_text(),
                     nav=page.locator("nav.md-nav--primary").inner_text(),
                     h1_box=page.locator("article h1").first.bounding_box())
    problems += [f"remote request: {u}" for u in urls if not u.startswith(("file:", "data:", "blob:"))]
    return {**shown, "problems": problems}


@pytest.mark.slow
class TestDocsInBrowser:
    def test_quickstart_renders(self, site):
        """The quickstart page shows its title, sections, the demo's commands and the Python example, in
        the site's navigation, with no script error or failed request."""
        shown = visit(site / "quickstart.html")
        assert shown["problems"] == []
        assert shown["h1"] == ["Quickstart"] and shown["h1_box"]["width"] > 100
        assert {"Install and run the demo", "Break it", "The Monitor in ten lines"} <= set(shown["h2"])
        assert any("make demo" in c for c in shown["code"])
        assert any("Monitor(MonitorConfig(run_dir=\"runs/quickstart\"" in c for c in shown["code"])
        assert "API reference" in shown["nav"] and "Halting, quarantine and correction" in shown["nav"]

    def test_api_page_renders_the_docstrings(self, site):
        """The top-level API page shows every name of `rlcheck.__all__` with its docstring's text."""
        import rlcheck

        shown = visit(site / "api" / "rlcheck.html")
        assert shown["problems"] == []
        assert shown["h1"] == ["rlcheck"]
        names = [n for n in rlcheck.__all__ if n != "__version__"]
        assert [n for n in names if f"rlcheck.{n}" not in shown["ids"]] == []
        assert sorted(h.split()[0] for h in shown["h3"]) == sorted(names)
        assert "Raised by Monitor.observe after the halt policy fired" in " ".join(shown["text"].split())
        assert "observe" in shown["text"] and "StepBatch.from_ragged" in shown["text"]
