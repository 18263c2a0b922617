"""The README is a front door: short, and linking every page of docs/, where the detail
lives (the generated tables among them, no longer in the README)."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(30)

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    pages = sorted(page.relative_to(REPO_ROOT).as_posix() for page in DOCS.rglob("*.md"))
    assert len(pages) >= 19
    assert [page for page in pages if f"]({page})" not in text] == []


def test_every_docs_page_has_a_title():
    for page in DOCS.rglob("*.md"):
        lines = [line for line in page.read_text().splitlines() if line and not line.startswith("<!--")]
        assert lines[0].startswith("# "), page


def test_the_generated_tables_live_in_the_docs():
    text = README.read_text()
    for marker in ("<!-- metrics:begin -->", "<!-- gpu-check:begin -->"):
        assert marker not in text
    assert "<!-- metrics:begin -->" in (DOCS / "metrics.md").read_text()
    assert "<!-- gpu-check:begin -->" in (DOCS / "benchmarks.md").read_text()
