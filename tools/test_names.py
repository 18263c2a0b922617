"""Fail when two test modules share a file name.

pytest imports test modules by their base name (the default "prepend" import mode, which
the tests' helper modules beside them rely on), so a second ``test_x.py`` in another folder
is an error at collection, found only when the whole suite runs. This says which files
collide before any test starts (``make lint``).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path


def collisions(root: Path) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("test_*.py")):
        by_name[path.name].append(str(path.relative_to(root.parent)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def main() -> int:
    found = collisions(Path(__file__).resolve().parent.parent / "tests")
    for name, paths in found.items():
        print(f"error: test module name {name} is used by {', '.join(paths)}; "
              "rename one (pytest imports test modules by file name)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
