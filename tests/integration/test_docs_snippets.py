"""The docs' Python snippets that need vLLM, Ray, TRL or verl (tests/docs_snippets.py; their environments in
tests/docs_envs_slow.py), each run as printed in a process of its own (`python -m tests.docs_snippets run
PAGE INDEX`), in a fresh directory: a vLLM engine, a Ray session or TRL's patched classes never outlive
their snippet."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import docs_snippets as snippets

SLOW: list[snippets.Snippet] = []
for _s in snippets.collect():
    if snippets.ENVS.get(_s.env, snippets.Env()).slow and (_s.env, _s.code) not in {(s.env, s.code) for s in SLOW}:
        SLOW.append(_s)
"""Each slow snippet once: a block printed on two pages with the same environment (the README's TRL and
verl snippets are their pages' first ones) runs once, under its first page's name."""


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SLOW, ids=lambda s: s.id)
def test_runs_as_printed(snippet, tmp_path):
    """The snippet runs with its environment (a tiny model where the page names a model folder) and does
    what its page says."""
    env = dict(os.environ, PYTHONPATH=str(snippets.ROOT), COLUMNS="120", RAY_AUTH_MODE="disabled")
    out = subprocess.run([sys.executable, "-m", "tests.docs_snippets", "run", snippet.page, str(snippet.index)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
