"""Write `tests/durations.json`, the seconds each test file took, from the report pytest
prints with `--durations=0`, for instance of a whole run:

    make test PYTEST=".venv/bin/python -m pytest -q --durations=0" | tee test.log
    python tools/test_durations.py test.log

`make test` runs the files in two processes, each file whole in one (`--dist loadfile`),
handing out the slowest files first (the tests' conftest orders them by this file), so
that no long file is left to run alone at the end while the other process has finished:
pytest-xdist would otherwise hand out the files with the most tests first, and the
slowest files hold one or two tests each. A file missing here (a new one) counts as
fast; the figures only order the files, and no test reads them.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"
LINE = re.compile(r"^(?P<s>\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+(?P<file>[\w./-]+\.py)::", re.M)


def durations(text: str) -> dict[str, float]:
    """Seconds per test file of a `--durations` report (setup, call and teardown summed)."""
    seconds: dict[str, float] = defaultdict(float)
    for match in LINE.finditer(text):
        seconds[match["file"]] += float(match["s"])
    return dict(seconds)


def main(logs: list[str]) -> int:
    if not logs:
        print("usage: python tools/test_durations.py LOG [LOG ...]", file=sys.stderr)
        return 2
    seconds: dict[str, float] = defaultdict(float)
    for log in logs:
        for file, s in durations(Path(log).read_text(errors="replace")).items():
            seconds[file] = max(seconds[file], s)  # of several reports, each file's longest
    ordered = dict(sorted(((file, round(s, 1)) for file, s in seconds.items()),
                          key=lambda item: (-item[1], item[0])))
    OUT.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{OUT.name}: {len(ordered)} files, {sum(ordered.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
