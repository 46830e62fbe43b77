"""mkdocs hook (mkdocs.yml `hooks:`): pages that show a repository file as it is, with no second copy.

A page's line `<!-- include -->[text](../BENCHMARKS.md)` is, on GitHub, a link to the repository file;
in the site it is replaced by the file itself (BENCHMARKS.md, RELIABILITY.md, ARCHITECTURE.md). The
file's links are written for the repository root; the site serves docs/ only, so each is rewritten
for the page:

- a link into docs/ (`docs/sync-scaling.png`) points at that file from the page;
- a link to an included file (or README.md) points at the page that shows it (INCLUDED);
- a link to any other repository path becomes its text and the path in code, since no page holds it.

A list that starts right under a paragraph line (GitHub renders it as a list, Python-Markdown as more of
the paragraph) gets the blank line Python-Markdown needs.

Plain text in, plain text out: `mkdocs build --strict` then checks the rewritten links like any other.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r"^<!-- include -->\[[^\]]*\]\((\S+)\)$", re.MULTILINE)
ITEM = re.compile(r"^\s*(?:[-*]|\d+\.) ")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s#]*)(#[^)\s]*)?\)")
INCLUDED = {"BENCHMARKS.md": "benchmarks-full.md", "RELIABILITY.md": "reliability.md",
            "ARCHITECTURE.md": "architecture.md", "README.md": "index.md"}
"""Repository file -> the docs page that shows it."""


def rewrite_link(match: re.Match, name: str, page_dir: str) -> str:
    """One Markdown link of repository file `name`, made to work from a page in `page_dir`."""
    bang, label, target, anchor = match.group(1), match.group(2), match.group(3), match.group(4) or ""
    if not target or "://" in target or target.startswith("mailto:"):
        return match.group(0)
    path = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if path.startswith("docs/"):
        return f"{bang}[{label}]({posixpath.relpath(path[len('docs/'):], page_dir or '.')}{anchor})"
    if path in INCLUDED:
        return f"[{label}]({posixpath.relpath(INCLUDED[path], page_dir or '.')}{anchor})"
    return label if label == f"`{path}`" else f"{label} (`{path}`)"


def included_name(target: str, page_uri: str) -> str:
    """The repository path of an include line's link target, written from the page at `page_uri`."""
    return posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))


def separate_lists(text: str) -> str:
    """A blank line before each list that follows a paragraph line directly (not inside code fences)."""
    out: list[str] = []
    in_fence = in_list = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and ITEM.match(line):
            if out and out[-1].strip() and not in_list and not out[-1].lstrip().startswith("|"):
                out.append("")
            in_list = True
        elif not line.strip():
            in_list = False
        out.append(line)
    return "\n".join(out)


def include(name: str, page_uri: str) -> str:
    """Repository file `name` with its links rewritten for the page at `page_uri` (docs-relative)."""
    text = separate_lists((ROOT / name).read_text())
    page_dir = posixpath.dirname(page_uri)
    return LINK.sub(lambda m: rewrite_link(m, name, page_dir), text)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    uri = page.file.src_uri
    return INCLUDE.sub(lambda m: include(included_name(m.group(1), uri), uri), markdown)
