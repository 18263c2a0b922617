"""The docs site builds with MkDocs in strict mode (a broken link or anchor fails it), and
renders in a real headless browser (Debian's chromium): the home page (the README), the
config reference with a row per key, and the GPU check's figures on the benchmarks page,
with nothing fetched from outside the site."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install '.[docs]')")
    folder = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(folder)], cwd=REPO_ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder


def test_the_site_builds_in_strict_mode_with_every_page(site):
    pages = {path.relative_to(site).as_posix() for path in site.rglob("index.html")}
    assert {"index.html", "getting-started/index.html", "reference/config/index.html",
            "reference/flags/index.html", "changelog/index.html", "benchmarks/index.html"} <= pages
    docs = {path.relative_to(REPO_ROOT / "docs").with_suffix("").as_posix()
            for path in (REPO_ROOT / "docs").rglob("*.md")}
    assert sorted(page for page in docs if f"{page}/index.html" not in pages) == []


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def test_the_pages_render_in_a_real_browser(served, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium installed (apt-get install chromium) to open the docs site with")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright drives the browser")
    requests: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("request", lambda request: requests.append(request.url))
            page.goto(f"{served}/", wait_until="load")
            home = (page.title(), page.inner_text("article h1"), page.locator("article table").count())
            page.goto(f"{served}/reference/config/", wait_until="load")
            keys = page.eval_on_selector_all("article table tbody tr td:first-child code",
                                             "cells => cells.map(c => c.textContent)")
            page.goto(f"{served}/benchmarks/", wait_until="load")
            gpu_rows = page.eval_on_selector_all("article table tbody tr",
                                                 "rows => rows.map(r => r.innerText)")
            page.screenshot(path=str(tmp_path / "benchmarks.png"))
        finally:
            browser.close()
    assert "disttrain" in home[0] and home[1].startswith("disttrain") and home[2] >= 3
    assert {"training.batch_size", "ps.overlap", "compression.pull", "coordinator.address"} <= set(keys)
    assert any(row.startswith("resnet18") and "1893/s" in row for row in gpu_rows)
    assert (tmp_path / "benchmarks.png").stat().st_size > 10_000
    assert [url for url in requests if not url.startswith(served)] == []
