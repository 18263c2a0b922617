"""Write docs/security.md's authorization table from the code (`disttrain.core.access`).

The table stands between the markers `<!-- access:begin -->` and `<!-- access:end -->`;
tests/unit/test_access_rules.py fails while it differs from `disttrain.core.access.markdown()`.
Run: python tools/access_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from disttrain.core import access

PAGE = Path(__file__).resolve().parents[1] / "docs" / "security.md"
BEGIN, END = "<!-- access:begin -->\n", "<!-- access:end -->\n"


def render(text: str) -> str:
    """`text` with the block between the markers replaced by the table.

    Raises:
        ValueError: a marker is missing.
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"the markers {BEGIN.strip()} and {END.strip()} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + access.markdown() + "\n" + END + tail


def main() -> int:
    try:
        PAGE.write_text(render(PAGE.read_text()))
    except ValueError as e:
        print(f"{PAGE}: {e}", file=sys.stderr)
        return 1
    print(f"wrote the authorization table into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
