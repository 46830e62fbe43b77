"""The report in a real browser: the synthetic demo writes it, headless Chromium (the system's, driven by
playwright) loads it with no console error, page error, failed or remote request, and draws every plot."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

RLCHECK = str(Path(sys.executable).with_name("rlcheck"))
INSTALL = "apt-get install -y --no-install-recommends chromium"


def chromium() -> str:
    """The system Chromium; its absence fails the test with the line that installs it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and Path("/usr/bin/chromium").is_file():
        path = "/usr/bin/chromium"
    if path is None:
        pytest.fail(f"the report's browser test needs the system Chromium (playwright drives it; `playwright install` "
                    f"is not used): {INSTALL}")
    return path


@contextlib.contextmanager
def watched_page(problems: list[str], urls: list[str]) -> Iterator:
    """A page of headless Chromium (1280 x 900); its console errors, page errors and failed requests go
    into `problems` and every request's URL into `urls` (the docs site's browser test uses it too)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url} {r.failure}"))
            page.on("request", lambda r: urls.append(r.url))
            yield page
        finally:
            browser.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """report.html of a synthetic demo run (periodic spikes, a halt, a dump), written by the demo itself."""
    run = tmp_path_factory.mktemp("browser") / "demo"
    out = subprocess.run([RLCHECK, "demo", "--synthetic", "--no-wandb", "--run-dir", str(run)], capture_output=True,
                         text=True, env=dict(os.environ, COLUMNS="120"), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"report: {run / 'report.html'}" in out.stdout
    return run / "report.html"


@pytest.mark.slow
class TestReportInBrowser:
    def test_loads_cleanly_and_draws(self, report):
        """No console error, page error, failed or non-local request; every plot has a size; the page is not blank."""
        from PIL import Image

        problems: list[str] = []
        urls: list[str] = []
        with watched_page(problems, urls) as page:
            page.goto(report.as_uri(), wait_until="load")
            boxes = [svg.bounding_box() for svg in page.locator("figure.plot svg").all()]
            tips = page.locator("svg g[id*='-alarm-'] > title").count()
            png = page.screenshot(full_page=True)
        assert problems == []
        assert all(u.startswith(("file:", "data:")) for u in urls), urls
        assert len(boxes) >= 8 and all(b is not None and b["width"] > 200 and b["height"] > 80 for b in boxes), boxes
        assert tips > 0
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"))  # (H, W)
        assert pixels.shape[0] > 1500 and (pixels < 235).mean() > 0.03
