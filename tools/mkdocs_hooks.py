"""MkDocs hooks of the docs site (mkdocs.yml): the README is the site's home page
(`index.md`) and CHANGELOG.md its `changelog.md`, each read from the repository's own
file at build time, with its links made relative to docs/, so neither is written twice."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO_ROOT = Path(__file__).resolve().parents[1]
# page in the site -> the repository's file it is made from
GENERATED_PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}


def site_text(text: str) -> str:
    """A repository-root page's text as a page of docs/: `docs/x.md` links become `x.md`,
    and links to the README and the changelog become the pages made from them."""
    text = re.sub(r"\]\(docs/", "](", text)
    for page, source in GENERATED_PAGES.items():
        text = text.replace(f"]({source})", f"]({page})")
    return text


def on_files(files: Files, config) -> Files:
    for page, source in GENERATED_PAGES.items():
        files.append(File.generated(config, page, content=site_text((REPO_ROOT / source).read_text())))
    return files
