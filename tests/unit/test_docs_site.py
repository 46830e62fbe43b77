"""The docs site (mkdocs.yml, docs/): it builds with --strict, every page is in the nav, every Python
snippet runs as printed (tests/docs_snippets.py; those needing vLLM, Ray, TRL or verl in
tests/integration/test_docs_snippets.py), the pages state the defaults the code has, and the README
stays a front door whose links lead into the docs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docs_snippets as snippets

ROOT = snippets.ROOT
DOCS = snippets.DOCS
MKDOCS = str(Path(sys.executable).with_name("mkdocs"))
FAST = [s for s in snippets.collect() if not snippets.ENVS.get(s.env, snippets.Env()).slow]


def page(name: str) -> str:
    """A docs page's text, its lines joined (the checks read sentences that wrap)."""
    return " ".join((DOCS / name).read_text().split())


def load_hooks():
    """docs/hooks.py, the mkdocs hook that includes repository files (not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def nav_pages(nav) -> list[str]:
    """Every page file mkdocs.yml's nav names."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return [p for item in nav for p in nav_pages(item)]


class TestBuild:
    def test_strict_build_passes(self, tmp_path):
        """`mkdocs build --strict` (what `make docs` runs) succeeds: no broken link, anchor or API reference."""
        out = subprocess.run([MKDOCS, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                                "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "WARNING" not in out.stderr, out.stderr[-3000:]
        assert (tmp_path / "site/quickstart.html").is_file() and (tmp_path / "site/api/rlcheck.html").is_file()

    def test_every_page_is_in_the_nav(self):
        """The nav lists every page under docs/ and names no missing one."""
        import yaml

        config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
        files = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
        assert sorted(nav_pages(config["nav"])) == sorted(files)

    def test_api_pages_cover_the_public_areas(self):
        """Each public area has its `::: module` on an API page; the top-level page renders `rlcheck` whole."""
        text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
        areas = ["rlcheck", "rlcheck.integrations.trl", "rlcheck.integrations.verl", "rlcheck.loop",
                 "rlcheck.core.detect", "rlcheck.core.moe", "rlcheck.faults", "rlcheck.forensics.diagnose",
                 "rlcheck.forensics.replay", "rlcheck.forensics.localize", "rlcheck.forensics.stress",
                 "rlcheck.sinks", "rlcheck.engines.vllm", "rlcheck.preflight", "rlcheck.distributed"]
        assert [a for a in areas if not re.search(rf"^::: {re.escape(a)}$", text, re.MULTILINE)] == []

    def test_included_files_exist(self):
        """Every include line of a page links a repository file (docs/hooks.py puts the file there)."""
        hooks = load_hooks()
        names = [hooks.included_name(m.group(1), p.relative_to(DOCS).as_posix())
                 for p in DOCS.rglob("*.md") for m in hooks.INCLUDE.finditer(p.read_text())]
        assert sorted(names) == ["ARCHITECTURE.md", "BENCHMARKS.md", "RELIABILITY.md"]
        assert all((ROOT / n).is_file() for n in names)


class TestIncludeHook:
    def test_links_are_rewritten_for_the_page(self, tmp_path, monkeypatch):
        """A repository file's links work from the page: into docs/ relative, an included file to its page,
        any other path as code; an include line's target is read from the page's folder."""
        hooks = load_hooks()
        (tmp_path / "X.md").write_text("![p](docs/a.png) [b](RELIABILITY.md#x) [c](benchmarks/b.py) [d](https://e.f)")
        monkeypatch.setattr(hooks, "ROOT", tmp_path)
        assert hooks.include("X.md", "forensics/page.md") == (
            "![p](../a.png) [b](../reliability.md#x) c (`benchmarks/b.py`) [d](https://e.f)")
        assert hooks.included_name("../../X.md", "forensics/page.md") == "X.md"

    def test_a_list_under_a_paragraph_gets_its_blank_line(self):
        """A list right under a paragraph line becomes a list in the site too; code fences are left alone."""
        hooks = load_hooks()
        assert hooks.separate_lists("text:\n- a\n- b\n\n```\nx:\n- y\n```") == "text:\n\n- a\n- b\n\n```\nx:\n- y\n```"


class TestSnippets:
    def test_every_marker_names_an_environment(self):
        """Every snippet's environment exists, every environment serves a snippet, and the pages have them all."""
        found = snippets.collect()
        assert {s.env for s in found} - set(snippets.ENVS) == set()
        assert set(snippets.ENVS) - {s.env for s in found} - {"plain"} == set()
        assert len(found) >= 14 and all(s.code.strip() for s in found)

    def test_a_marker_must_precede_a_block(self):
        """A marker followed by anything but a Python block is an error, not a silently plain snippet."""
        with pytest.raises(ValueError, match="not followed"):
            snippets.parse("<!-- snippet: trl -->\n\ntext\n\n```python\nx = 1\n```\n", "p.md")
        got = snippets.parse("<!-- snippet: trl -->\n\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n", "p.md")
        assert [(s.env, s.line, s.code) for s in got] == [("trl", 4, "x = 1\n"), ("plain", 8, "y = 2\n")]

    @pytest.mark.parametrize("snippet", FAST, ids=lambda s: s.id)
    def test_runs_as_printed(self, snippet, tmp_path):
        """The snippet runs in a fresh directory with its environment, and does what its page says."""
        snippets.run(snippet, tmp_path)


class TestDefaults:
    def test_halt_defaults_match(self):
        """The Halting page's tables hold HaltConfig's defaults and every default hard limit."""
        from rlcheck.core.monitor import DEFAULT_HARD_LIMITS, HaltConfig

        text, h = page("halting.md"), HaltConfig()
        assert all(f"| `{key}` | {limit:g} |" in text for key, limit in DEFAULT_HARD_LIMITS.items())
        assert f"| `patience` | `{h.patience}` |" in text and f"| `min_severity` | `{h.min_severity}` |" in text

    def test_threshold_gates_match(self):
        """The Detectors page states every default threshold gate with its value."""
        from rlcheck.core.detect import ThresholdConfig

        text = page("detectors.md")
        assert all(f"`{r.metric.removeprefix('rlcheck/token/')}` > {r.limit:g}" in text for r in ThresholdConfig().rules)

    def test_quarantine_defaults_match(self):
        """The quarantine page's table is QuarantineConfig's defaults."""
        from rlcheck.core.quarantine import REASONS, QuarantineConfig

        text, q = page("quarantine.md"), QuarantineConfig()
        assert q.rules == REASONS and len(REASONS) == 10 and "| `rules` | all ten |" in text
        assert f"| `max_frac` | {q.max_frac:g} |" in text and f"| `max_dumped` | {q.max_dumped} |" in text
        assert f"| `patience` | `{q.patience}` |" in text

    def test_forensics_defaults_match(self):
        """The replay and stress pages state the tools' defaults."""
        from rlcheck.forensics import DEFAULT_TAU, DEFAULT_THRESHOLD
        from rlcheck.forensics.render import show_value
        from rlcheck.forensics.stress import FP32_THRESHOLD, StressConfig
        from rlcheck.forensics.sweep import SWEEP_REQUESTS

        replay, stress, c = page("forensics/replay.md"), page("forensics/stress.md"), StressConfig(model="m")
        assert f"`--threshold` (default {DEFAULT_THRESHOLD:g} nats)" in replay and f"`--tau`, {DEFAULT_TAU:g}," in replay
        assert (f"Defaults: {c.num_requests} requests, {c.samples_per_prompt} per prompt, {c.max_tokens} tokens, "
                f"max_num_seqs {c.max_num_seqs}, {show_value('kv_cache_bytes', c.kv_cache_bytes)[:-3]} MiB") in stress
        assert f"(default {FP32_THRESHOLD:g} nats in float32" in stress
        assert f"`--requests` defaults to {SWEEP_REQUESTS} per value" in stress


class TestReadme:
    def test_is_a_front_door(self):
        """At most ~300 lines, with what it is, install, the two commands, the three integrations, a halt
        and the way into the docs."""
        text = snippets.README.read_text()
        assert len(text.splitlines()) <= 300
        for needed in ("make demo", "make test", "## Install", "### Your own loop", "### TRL", "### verl",
                       "## What a halt looks like", "## Documentation"):
            assert needed in text, needed
        assert {s.env for s in snippets.parse(text, "README.md")} == {"own-loop", "trl", "verl"}

    def test_slow_snippets_are_the_pages_own(self):
        """The README's TRL and verl snippets are printed as they are on their pages, so the page's run
        (tests/integration/test_docs_snippets.py runs each block once) is the README's."""
        pages = {(s.env, s.code) for s in snippets.collect() if s.page != "README.md"}
        readme = snippets.parse(snippets.README.read_text(), "README.md")
        assert [s.env for s in readme if (s.env, s.code) in pages] == ["trl", "verl"]

    def test_links_lead_to_files(self):
        """Every relative link of the README names a file of the repository (docs/... pages, images)."""
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", snippets.README.read_text())
        local = [link for link in links if "://" not in link]
        assert len([link for link in local if link.startswith("docs/")]) >= 10
        assert [link for link in local if not (ROOT / link).exists()] == []
