"""Every link of the README and of docs/ leads somewhere: a relative link names a file of
the repository, and its #anchor a heading of that page under the rules of both GitHub and
MkDocs (the two places the pages are read)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]]+)\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    outside = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", outside)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings that GitHub and MkDocs both give."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M):
        plain = re.sub(r"[`*]", "", heading).strip().lower()
        github = re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")
        mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", plain).strip())
        if github == mkdocs:
            found.add(github)
    return found


def broken_links(page: Path, root: Path = REPO_ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            problems.append(f"{page.relative_to(root)}: {target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination.read_text()):
            problems.append(f"{page.relative_to(root)}: {target}: no such heading")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_link_leads_somewhere(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Local updates (LocalSGD / DiLoCo)\n\n## Two words\n")
    page.write_text("[a](other.md#two-words) [b](missing.md) [c](other.md#nowhere) `[d](nowhere.md)`\n"
                    "[e](other.md#local-updates-localsgd--diloco) [f](https://example.org)\n")
    found = [line.split(": ", 1)[1] for line in broken_links(page, root=tmp_path)]
    assert found == ["missing.md: no such file", "other.md#nowhere: no such heading",
                     "other.md#local-updates-localsgd--diloco: no such heading"]

