"""The block of a docs page between two marker lines, written again by the tools that
generate part of a page from the code or a benchmark's JSON (metrics_table, gpu_readme,
chaos_figures)."""

from __future__ import annotations

import sys
from pathlib import Path


def write_block(page: Path, begin: str, end: str, body: str) -> bool:
    """Put `body` between `begin` and `end` (whole lines) in `page`; False, said on
    stderr, when the page lacks a marker."""
    text = page.read_text()
    if begin not in text or end not in text:
        print(f"{page}: the markers {begin.strip()} and {end.strip()} are missing", file=sys.stderr)
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(head + begin + body + end + tail)
    return True
