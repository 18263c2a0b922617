"""Write docs/metrics.md's tables from the metrics vocabulary (`make metrics-table`).

The tables stand between the markers `<!-- metrics:begin -->` and `<!-- metrics:end -->`;
tests/unit/test_metrics.py fails while they differ from `disttrain.metrics.keys.markdown()`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from disttrain.metrics import keys

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
BEGIN, END = "<!-- metrics:begin -->\n", "<!-- metrics:end -->\n"


def main() -> int:
    text = PAGE.read_text()
    if BEGIN not in text or END not in text:
        print(f"{PAGE}: the markers {BEGIN.strip()} and {END.strip()} are missing", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(head + BEGIN + "\n" + keys.markdown() + "\n" + END + tail)
    print(f"wrote the metrics tables into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
