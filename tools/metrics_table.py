"""Write docs/metrics.md's tables from the metrics vocabulary (`make metrics-table`).

The tables stand between the markers `<!-- metrics:begin -->` and `<!-- metrics:end -->`;
tests/unit/test_metrics.py fails while they differ from `disttrain.metrics.keys.markdown()`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from markers import write_block

from disttrain.metrics import keys

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
BEGIN, END = "<!-- metrics:begin -->\n", "<!-- metrics:end -->\n"


def main() -> int:
    if not write_block(PAGE, BEGIN, END, "\n" + keys.markdown() + "\n"):
        return 1
    print(f"wrote the metrics tables into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
